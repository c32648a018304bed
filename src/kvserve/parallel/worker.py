"""A worker: one of ranks 1..N-1 of a tensor-parallel engine, in a process of its own, running its shard of the
model on its shard of the KV pool as rank 0 steers it.

It joins the group, loads its shard (the parallel layers cut it from the checkpoint, quantized as rank 0's), builds
its pool when told, then runs each step rank 0 sends it: first the changes rank 0 made to its pool and tier since
the last step (its evictor's compactions, the tier's saves and loads: made here to this rank's pages and tier),
then the same block copies and writes, the same forward (by the C step where rank 0 runs it so), its collectives
meeting rank 0's. A failure is told to rank 0 before the process exits.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.config import ModelConfig
from kvserve.kv import KVStorage, NoKVStorage
from kvserve.parallel.channel import ShmChannel, dumps, loads
from kvserve.parallel.group import init_group, pin_cpu_threads


@dataclass
class WorkerArgs:
    """What a worker builds its shard from: the same model, dtype, attention backend and weights as rank 0."""

    model_path: Path
    model_config: ModelConfig
    dtype: torch.dtype
    device: str
    max_model_len: int
    attention_backend: str
    cpu_allocator_tuning: bool
    weight_format: str                  # rank 0's GEMM choice (model/gemm_choice.py)
    # rank 0's layers' rows from which csrc/gemm.c runs AMX (GemmChoice.amx_from)
    amx_from: dict[str, int] = field(default_factory=dict)
    native: bool = False                # the C decode step runs the steps rank 0 marks native (native_tp)
    quantization: str | None = None     # of the linear layers' weights, as rank 0's (EngineConfig.quantization)
    # rank 0's layers' rows from which csrc/gemm.c runs its kernels of quantized weights (GemmChoice's)
    widen_from: dict[str, int] = field(default_factory=dict)
    vnni_from: dict[str, int] = field(default_factory=dict)


# a change rank 0 made that a worker makes too, in order: (target, its method, the arguments), the target
# "storage" (the worker's KVStorage) or "connector" (its tier: parallel/connector.py's WorkerConnector)
Op = tuple[str, str, tuple]


@dataclass
class StepMessage:
    """One step, as a worker runs it: first the changes rank 0 made to the pool and tier since the last step, then
    the step's block copies and forward."""

    block_copies: list[tuple[int, int]]
    inputs: object                                   # executor.StepInputs (a hybrid cache: every group's tables)
    ops: list[Op]
    native: bool = False                             # run by the C decode step (executor native_tp), else eager


@dataclass
class OpsMessage:
    """Changes to make now, between steps (Workers.send_ops); with `reply`, the last one's value is sent back to
    rank 0 (Workers.call)."""

    ops: list[Op]
    reply: bool = False


def worker_main(rank: int, size: int, address: tuple[str, int] | dist.Store, args: WorkerArgs, conn,
                channel: str | None = None) -> None:
    """A worker's process: join the group (its store at `address`, or the store itself), load the shard, build
    the pool when told, then run steps (from ShmChannel `channel`, else from `conn`) until told to stop or rank 0
    goes away. A failure is reported to rank 0 before the process exits."""
    try:
        _serve(rank, size, address, args, conn, channel)
    except (EOFError, KeyboardInterrupt):
        pass                                       # rank 0 is gone
    except BaseException:  # noqa: BLE001  (told to rank 0, which raises it)
        try:
            conn.send_bytes(dumps(("error", traceback.format_exc())))
        except (OSError, RuntimeError):
            pass
        os._exit(1)


def _serve(rank: int, size: int, address: tuple[str, int] | dist.Store, args: WorkerArgs, conn,
           channel: str | None) -> None:
    from kvserve.attention import get_backend
    from kvserve.engine.cpu_memory import reuse_freed_memory
    from kvserve.engine.native_decode import NativeDecode
    from kvserve.kernels import library
    from kvserve.model.gemm_choice import GemmChoice
    from kvserve.model.layers import gemm_kernels
    from kvserve.model.loader import load_model
    from kvserve.parallel.connector import WorkerConnector

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        pin_cpu_threads(rank, size)
        if args.cpu_allocator_tuning:
            reuse_freed_memory()
        library()
    conn.send_bytes(dumps(("started", None)))
    if isinstance(address, dist.Store):
        tp = init_group(rank, size, "", 0, device, address)
    else:
        tp = init_group(rank, size, *address, device)
    model = load_model(args.model_path, args.model_config, args.dtype, device, args.max_model_len, args.weight_format,
                       args.quantization, tp=tp)
    if args.weight_format == "gemm":
        gemm_kernels(args.dtype)        # the OS grants AMX's tile state to each process that asks (as rank 0 did)
    GemmChoice(args.weight_format, "rank 0's", args.amx_from, widen_from=args.widen_from,
               vnni_from=args.vnni_from).apply(model)
    backend = get_backend(args.attention_backend, device)
    _, spec, num_blocks, layer_groups, ops = loads(conn.recv_bytes(), device)
    storage = NoKVStorage(spec.num_layers) if num_blocks is None else KVStorage(spec, num_blocks, device, layer_groups)
    targets = {"storage": storage, "connector": WorkerConnector(rank, storage, device)}
    _run_ops(targets, ops)
    native = NativeDecode(model, storage) if args.native else None
    steps = ShmChannel(size - 1, channel) if channel is not None else None
    conn.send_bytes(dumps(("ready", None)))
    while True:
        msg = loads(conn.recv_bytes() if steps is None else steps.recv(rank - 1, conn), device)
        if isinstance(msg, OpsMessage):
            result = _run_ops(targets, msg.ops)
            if msg.reply:
                conn.send_bytes(dumps(("result", result)))
            continue
        if not isinstance(msg, StepMessage):
            return                                 # ("exit",)
        _run_ops(targets, msg.ops)
        _run_step(model, backend, storage, native, msg)


def _run_ops(targets: dict[str, object], ops: list[Op]):
    """Make rank 0's changes, in its order, each by `method` of its target: what the last one returns."""
    result = None
    for target, method, args in ops:
        result = getattr(targets[target], method)(*args)
    return result


@torch.inference_mode()
def _run_step(model, backend, storage: KVStorage | NoKVStorage, native, msg: StepMessage) -> None:
    """Rank 0's step on this rank's shard: the same block copies and writes, the same forward (by `native`, the
    C step, where rank 0 runs it so; its collectives meet rank 0's), and this rank's vocabulary shard of the
    logits and its heads' attention mass gathered to rank 0."""
    inputs = msg.inputs
    storage.copy_blocks(msg.block_copies)
    model.ensure_rope(int(inputs.positions.max()) + 1)
    if msg.native:
        native.run(inputs.input_ids, inputs.positions, inputs.batch)
        return
    batch = inputs.batch
    hidden = model(inputs.input_ids, inputs.positions, batch, backend, storage)
    model.compute_logits(hidden[torch.cat((inputs.logits_indices, inputs.prompt_indices))])
    if batch.mass_requests:
        reduces = {row: reduce for row, _, _, reduce in batch.mass_requests}
        model.tp.gather_mass({row: torch.cat(layers) for row, layers in batch.mass.items()}, reduces, model.config)
