"""Find a checkpoint (local directory or hub id), load its weights and tokenizer."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.config import ModelConfig, parse_dtype
from kvserve.model.decoder import CausalLM

log = logging.getLogger(__name__)
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo-model"
# the files a tokenizer's vocabulary is read from (tokenizer_config.json alone names a class, not a vocabulary):
# tokenizers' JSON, sentencepiece models, BPE vocab + merges, WordPiece vocab, tiktoken ranks
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "*.model",
                   "*.tiktoken")
_CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.json", "*.txt", *TOKENIZER_FILES]


def resolve_model(model: str | None) -> Path:
    """A local checkpoint directory for `model`: a path, a cached or downloadable hub id, or the demo."""
    if model is None:
        if not (DEMO_MODEL_DIR / "config.json").exists():
            raise FileNotFoundError(f"no model given and the bundled demo model is not installed at "
                                    f"{DEMO_MODEL_DIR}; pass model=PATH to a Hugging Face checkpoint")
        return DEMO_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
        return path
    if path.suffix or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is neither a checkpoint directory nor a hub id "
                                f"of the form owner/name")
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_CHECKPOINT_FILES, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_CHECKPOINT_FILES))
    except Exception as e:
        raise FileNotFoundError(f"model {repo_id!r} is not in the local Hugging Face cache and could "
                                f"not be downloaded ({type(e).__name__}: {e})") from None


def choose_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, except float16 on the CPU, which runs in float32."""
    if dtype != "auto":
        return parse_dtype(dtype)
    ckpt = cfg.torch_dtype or torch.float32
    return torch.float32 if ckpt == torch.float16 and device.type == "cpu" else ckpt


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, pack_weights: bool = True) -> CausalLM:
    model = _empty_model(cfg, dtype, device)
    load_weights(model, path)
    if pack_weights:
        model.pack_weights()
    model.init_rope(max_positions, device)
    return model.eval().requires_grad_(False)


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model with uninitialised parameters, allocated where and as they will be used (not on the
    meta device: moving off it goes through torch's Python reference ops, half a second of imports)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return CausalLM(cfg)
    finally:
        torch.set_default_dtype(default)


def load_weights(model: CausalLM, path: Path) -> None:
    """Copy every tensor of the *.safetensors files into the model; all parameters must be covered."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    missing = {_part(n, s) for n in params for s in _shards_of(n)}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target, shard = _target(name, model.config.tie_word_embeddings)
                if target is None:
                    continue
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
                merged = target.split(".")[-2]
                dst = params[target].data
                if shard is not None:
                    dst = dst[model.shard_slice(merged, shard)]
                src = f.get_tensor(name)
                if src.shape != dst.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(src)
                # a checkpoint's fused tensor (Phi-3's qkv_proj, gate_up_proj) fills every shard of its parameter
                missing -= {_part(target, s) for s in ([shard] if shard is not None else _shards_of(target))}
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing))}")


def _target(name: str, tied: bool) -> tuple[str | None, int | None]:
    """The parameter (and shard within it) that a checkpoint tensor fills; None for tensors to skip."""
    if "rotary_emb" in name or (name == "lm_head.weight" and tied):
        return None, None
    for shard_name, (merged, shard) in CausalLM.stacked_params.items():
        if f".{shard_name}." in name:
            return name.replace(shard_name, merged), shard
    return name, None


def _shards_of(param: str) -> list[int | None]:
    merged = param.split(".")[-2] if "." in param else ""
    return sorted({s for m, s in CausalLM.stacked_params.values() if m == merged}) or [None]


def _part(param: str, shard: int | None) -> str:
    return param if shard is None else f"{param}[{shard}]"


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. A plain PreTrainedTokenizerFast (the demo model's) is built
    directly: AutoTokenizer would first import the model's config classes, a second of startup.
    A directory with none of the files a vocabulary is read from raises FileNotFoundError naming them
    (transformers would fail speaking of missing libraries, or build an empty tokenizer from a
    tokenizer_config.json alone)."""
    config = path / "tokenizer_config.json"
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        has = "tokenizer_config.json but" if config.exists() else "no tokenizer_config.json and"
        raise FileNotFoundError(
            f"{path} has no tokenizer: it has {has} none of {', '.join(TOKENIZER_FILES)}. Add the model's "
            f"tokenizer files, or pass skip_tokenizer_init=True (--skip-tokenizer-init) to give and get token ids "
            f"only")
    if config.exists() and json.loads(config.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))
