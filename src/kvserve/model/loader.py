"""Find a checkpoint (local directory or hub id), load its weights and tokenizer."""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvserve.config import ModelConfig, parse_dtype
from kvserve.engine.cpu_memory import cpu_tensor
from kvserve.model.decoder import CausalLM
from kvserve.model.layers import Linear
from kvserve.parallel.group import TensorParallel

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
               max_positions: int, weight_format: str = "plain", quantization: str | None = None,
               tp: TensorParallel | None = None) -> CausalLM:
    """The checkpoint's model (with `tp`: this rank's shard of it), each linear layer's weight held once in
    weight_format (Linear.load; quantized: every one, lm_head too): packed as it is read, so that at most a
    layer's plain weight is held beside the packed ones."""
    model = _empty_model(cfg, dtype, device, tp)
    load_weights(model, path, weight_format, quantization)
    model.init_rope(max_positions, device)
    return model.eval().requires_grad_(False)


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None) -> CausalLM:
    """The model with uninitialised parameters, allocated where and as they will be used (not on the
    meta device: moving off it goes through torch's Python reference ops, half a second of imports)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return CausalLM(cfg, tp)
    finally:
        torch.set_default_dtype(default)


class CheckpointTensor:
    """A tensor of a checkpoint, read from its file when a layer's weight_loader asks for its part of it: straight
    into the layer's parameter where that part is the whole tensor, else read whole once and cut."""

    def __init__(self, name: str, shape: tuple[int, ...], read: Callable[[str, torch.Tensor], None]):
        self.name, self.shape, self._read = name, shape, read
        self._whole: torch.Tensor | None = None

    def narrow_into(self, dst: torch.Tensor, dim: int = 0, start: int = 0) -> None:
        """dst = the tensor's dst.shape[dim] entries from `start` along `dim` (dst's other dimensions its own)."""
        if start == 0 and tuple(dst.shape) == self.shape:
            self._read(self.name, dst)
            return
        fits = len(dst.shape) == len(self.shape) and start + dst.shape[dim] <= self.shape[dim] and all(
            d == s for i, (d, s) in enumerate(zip(dst.shape, self.shape)) if i != dim)
        if not fits:
            raise ValueError(f"checkpoint tensor {self.name!r} has shape {self.shape}: no part of it fills "
                             f"{tuple(dst.shape)} from {start} along dimension {dim}")
        dst.copy_(self.whole(dst.dtype).narrow(dim, start, dst.shape[dim]))

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor in dtype, read once."""
        if self._whole is None:
            self._whole = torch.empty(self.shape, dtype=dtype)
            self._read(self.name, self._whole)
        return self._whole


def default_weight_loader(dst: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
    """A parameter that every rank holds whole (a norm's) takes the checkpoint tensor as it is."""
    loaded.narrow_into(dst)


def load_weights(model: CausalLM, path: Path, weight_format: str = "plain", quantization: str | None = None) -> None:
    """Copy every tensor of the *.safetensors files into the model, each by its layer's weight_loader (a
    tensor-parallel shard's layers take their part of it); all parameters must be covered. A linear layer's weight
    is assembled from its checkpoint tensors (q, k, v; gate, up) in a buffer of its own and, once whole, handed to
    Linear.load in weight_format (and quantization); a tied lm_head packs the embedding table, which then reads its
    rows from it (Embedding.share_with: quantized, its rows dequantized) where csrc/gemm.c packs it."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tied = model.config.tie_word_embeddings
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    linears = {f"{name}.weight": m for name, m in model.named_modules()
               if isinstance(m, Linear) and not (tied and m is model.lm_head)}
    missing = {_part(n, s) for n in params for s in _shards_of(n)}
    building: dict[str, torch.Tensor] = {}     # linear weight -> its buffer, until every shard is in
    for file in files:
        for name, shape, read in _tensors(file):
            target, shard = _target(name, tied)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
            if target in linears:
                linear = linears[target]
                dst = building.get(target)
                if dst is None:
                    dst = building[target] = _weight_buffer(linear, params[target].dtype, params[target].device)
            else:
                dst = params[target].data
            module = modules[target.rpartition(".")[0]]
            getattr(module, "weight_loader", default_weight_loader)(dst, CheckpointTensor(name, shape, read), shard)
            # a checkpoint's fused tensor (Phi-3's qkv_proj, gate_up_proj) fills every shard of its parameter
            missing -= {_part(target, s) for s in ([shard] if shard is not None else _shards_of(target))}
            if target in linears and not any(_part(target, s) in missing for s in _shards_of(target)):
                linears[target].load(building.pop(target), weight_format, quantization)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing))}")
    if tied:
        # packed for oneDNN, the table would be held twice: a tied lm_head is packed only where the table can
        # read its rows back from it (csrc/gemm.c's panels), else it multiplies by the table as it is
        embed, head = model.model.embed_tokens, model.lm_head
        if head.load(embed.weight.detach(), "gemm" if weight_format == "gemm" else "plain", quantization) == "gemm":
            embed.share_with(head)
        else:
            head.weight = embed.weight


def _weight_buffer(linear: Linear, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a linear layer's plain weight is assembled: on the CPU a mapping of its own, whose memory goes
    back to the system once the weight is packed (or stays as the plain weight, on huge pages)."""
    shape = (linear.out_features, linear.in_features)
    return cpu_tensor(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)


# safetensors' dtype names
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _tensors(file: Path) -> Iterator[tuple[str, tuple[int, ...], Callable[[str, torch.Tensor], None]]]:
    """Each tensor of a .safetensors file, in file order, as (name, shape, read), read(name, dst) copying it into
    dst (of its shape; any dtype and device). Read by plain file reads, not mapped: mapped, every page of the file
    would count in the process's resident memory until the file is closed, a second copy of the weights at
    the end of loading."""
    with open(file, "rb", buffering=0) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        head = f.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if header_len > size - 8:
            raise ValueError(f"{file} is not a safetensors file (its header length {header_len} exceeds the file)")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if dtype is None:
                raise ValueError(f"checkpoint tensor {name!r} in {file} has dtype {info['dtype']}, which kvserve does "
                                 f"not load (it takes {', '.join(_SAFETENSORS_DTYPES)})")
            if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
                raise ValueError(f"checkpoint tensor {name!r} in {file}: its data offsets do not match its shape "
                                 f"{shape} and dtype, or run past the file")

            def read(name: str, dst: torch.Tensor, begin: int = begin, shape: tuple = shape, dtype=dtype) -> None:
                if tuple(dst.shape) != shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {tuple(dst.shape)}")
                direct = dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous()
                into = dst if direct else torch.empty(shape, dtype=dtype)
                _read_exactly(f, base + begin, into.view(-1).view(torch.uint8).numpy())
                if not direct:
                    dst.copy_(into)

            yield name, shape, read


def _read_exactly(f, offset: int, buffer) -> None:
    """Fill buffer (a writable bytes-like object) from the file at offset."""
    view, done = memoryview(buffer).cast("B"), 0
    f.seek(offset)
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{f.name} ends before its tensors do")
        done += got


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
