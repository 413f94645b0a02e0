"""Transfer-to-CPU layer: lets unmodified megatron-core train on CPU with gloo.

Megatron hard-codes CUDA in a handful of ways; each is remapped here to its CPU meaning, the way
torch_npu's `transfer_to_npu` remaps them to NPU:

- `device='cuda'`, `device=torch.cuda.current_device()` in tensor factories, `.to(...)`, `.cuda()`
  and `Module.cuda()` -> CPU; `pin_memory=True` -> False.
- `torch.cuda.current_device/device_count/set_device/synchronize/empty_cache/memory_*` -> CPU answers.
- Streams and events -> inert objects (CPU work is already ordered), `torch.cuda.nvtx` -> no-ops.
- The CUDA RNG state (`torch.cuda.get/set_rng_state`, `manual_seed`, Megatron's RNG tracker) -> the
  CPU generator, so Megatron's `get_cuda_rng_tracker().fork()` swaps CPU generator states.
- `Tensor.type()` of a CPU float tensor -> the `torch.cuda.*Tensor` string Megatron's optimizers check.
- gloo collectives with unequal pieces (megatron's variable-size gather / reduce-scatter of the
  alltoall dispatcher at TP>1): padded all_gather, all-reduce-based reduce_scatter.
- `moe_utils.te_general_gemm` defined as None when Transformer Engine is absent; an eager
  `grouped_gemm.ops.gmm` for the legacy GroupedMLP; the alltoall dispatcher's device-to-host copy
  of split sizes (a no-op on CPU that must still return numpy when asked).
- Device-property queries, CUDA_DEVICE_MAX_CONNECTIONS and the sequence-parallel torch norm that TP>1 /
  CP>1 need: `mindspeed_proxy.patches.cpu_parallel` (rows of this feature).
- megatron-core's dynamic inference engine (flash-attn's paged-KV functions in torch, its sampling
  generator, the triton K/V append): `mindspeed_proxy.patches.cpu_inference` (rows of this feature).
- YaRN's `with torch.device(current_device())` (MLA's default rope): `mindspeed_proxy.patches.mla_local`.
- Megatron-LM's `train_rl.py` training step (its default packed-sequence params, which only Transformer
  Engine's attention takes): `mindspeed_proxy.patches.cpu_rl` (a row of this feature).
- `torch.compile` -> the function itself (eager): feature eager-jit (`mindspeed_proxy.patches.eager_jit`),
  applied first by `install()`, before any row below imports megatron-core, and reverted last.
- Megatron-LM's training side (`megatron.training`, when a checkout is on the path, so its
  `pretrain_gpt.py` runs unmodified): `initialize_megatron` gets its own `allow_no_cuda=True`, and the
  legacy `fused_kernels.load` (an nvcc probe) is a no-op. megatron-core's "CPU RNG state changed
  within GPU RNG context" warning, true by construction here, is filtered from its logger.

Numerics are untouched: every remap changes where a tensor lives or answers a query, never a value (the eager
`torch.compile` runs the functions' own torch ops, which inductor's fused C++ may round differently).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
from typing import Any

import torch

from mindspeed_proxy.patches import cpu_inference, cpu_parallel, cpu_rl, eager_jit, mla_local
from mindspeed_proxy.patches.registry import (BEFORE_0_17, MEGATRON_CORE_SUPPORTED, TORCH_SUPPORTED, Patch,
                                              apply_feature, register, revert_feature)

FEATURE = "cpu-platform"
# megatron-core versions (= Megatron-LM core_vX.Y tags) the Megatron-LM training rows below are
# written for: the patched call sites have the same shape in core_v0.12.0 .. core_v0.19.0 (read in
# their source); end to end they were run on core_v0.16.1 and core_v0.19.0 (docs/megatron_lm.md).
MEGATRON_LM_SUPPORTED = MEGATRON_CORE_SUPPORTED

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "rand", "randn",
    "randint", "randperm", "linspace", "logspace", "eye", "empty_strided", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "scalar_tensor",
    "tril_indices", "triu_indices", "normal", "frombuffer",
)
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


def cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (int, 'cuda', 'cuda:N', torch.device) to 'cpu'; leave others as given."""
    if device is None:
        return None
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str):
        return torch.device("cpu") if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _remap_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs:
        kwargs["device"] = cpu_device(kwargs["device"])
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _factory(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return original(*args, **_remap_kwargs(kwargs))

    return wrapper


def _to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (int, str, torch.device)) and not isinstance(args[0], bool):
            args = (cpu_device(args[0]),) + args[1:]
        return original(self, *args, **_remap_kwargs(kwargs))

    return to


def _tensor_new(original):
    @functools.wraps(original)
    def new(self, *args, **kwargs):
        return original(self, *args, **_remap_kwargs(kwargs))

    return new


def _tensor_cuda(_original):
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    return cuda


def _module_cuda(_original):
    def cuda(self, device=None):
        return self

    return cuda


def _tensor_pin_memory(_original):
    def pin_memory(self, device=None):
        return self

    return pin_memory


def _tensor_type(original):
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name) if self.device.type == "cpu" else name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class InertStream:
    """Stands in for torch.cuda.Stream on CPU, where all work is already ordered."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, stream):
        """No-op: CPU work is serial."""

    def wait_event(self, event):
        """No-op: CPU work is serial."""

    def record_event(self, event=None):
        """Return an inert event."""
        return event if event is not None else InertEvent()

    def synchronize(self):
        """No-op: CPU work is serial."""

    def query(self):
        """Always complete."""
        return True

    def __eq__(self, other):
        return isinstance(other, InertStream)

    def __hash__(self):
        return 0


class InertEvent:
    """Stands in for torch.cuda.Event on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        """No-op."""

    def wait(self, stream=None):
        """No-op."""

    def synchronize(self):
        """No-op."""

    def query(self):
        """Always complete."""
        return True

    def elapsed_time(self, other):
        """Not measurable on CPU; 0 ms."""
        return 0.0


_DEFAULT_STREAM = InertStream()


def _const(value):
    return lambda _original: (lambda *a, **k: value)


def _memory_stats(_original):
    """No device memory on CPU: every counter of `torch.cuda.memory_stats()` reads 0 (megatron-core's inference
    engine reads e.g. "allocated_bytes.all.current" when it suspends, resumes or logs a step)."""
    return lambda device=None: collections.defaultdict(int)


def _noop(_original):
    return lambda *a, **k: None


def _stream_ctx(_original):
    return lambda *a, **k: contextlib.nullcontext()


def _get_rng_state(_original):
    return lambda device="cuda": torch.get_rng_state()


def _set_rng_state(_original):
    return lambda new_state, device="cuda", *a, **k: torch.set_rng_state(new_state)


def _manual_seed(_original):
    return lambda seed: torch.default_generator.manual_seed(int(seed))


def _megatron_set_rng_state(_original):
    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return set_state


def _megatron_get_rng_state(_original):
    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    return get_state


class CPUGroupedGemmOps:
    """Eager stand-in for the `grouped_gemm` CUDA package used by megatron's legacy GroupedMLP."""

    @staticmethod
    def gmm(a, b, batch_sizes, trans_b=False):
        """Rows of `a` split by `batch_sizes`, group i multiplied by `b[i]` (transposed if trans_b)."""
        sizes = [int(n) for n in batch_sizes.tolist()]
        outs = [chunk @ (w.t() if trans_b else w) for chunk, w in zip(torch.split(a, sizes), b)]
        return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-2 if trans_b else -1])


class _GroupedGemmPackage:
    ops = CPUGroupedGemmOps


def _host_copy(_original):
    """On CPU every tensor is already on the host; still honour `as_numpy` as the CUDA path does."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    return maybe_move_tensor_to_cpu


def _uneven_all_gather(original):
    """gloo's all_gather needs equal shapes; megatron's variable-size gather (alltoall dispatcher with
    TP>1) passes unequal ones: pad each piece to the largest first dimension, gather, trim."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list}
        if len(shapes) == 1 and tuple(tensor.shape) in shapes:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        buffers = [tensor.new_empty(padded.shape) for _ in tensor_list]
        work = original(buffers, padded, group=group, async_op=False)
        for out, buf in zip(tensor_list, buffers):
            out.copy_(buf[: out.shape[0]])
        return work

    return all_gather


def _uneven_reduce_scatter(original):
    """gloo has no variable-size reduce_scatter: all-reduce the concatenation, keep this rank's piece."""

    @functools.wraps(original)
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in input_list}
        if len(shapes) == 1:
            return original(output, input_list, op=op, group=group, async_op=async_op)
        full = torch.cat([t.reshape(t.shape[0], -1) for t in input_list])
        torch.distributed.all_reduce(full, op=op, group=group)
        rank = torch.distributed.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(full[start:start + output.shape[0]].view_as(output))
        return None

    return reduce_scatter


def _fallback(value):
    return lambda original: original if original is not None else value


def _class(cls):
    return lambda _original: cls


def _te_installed(original):
    """megatron-core's MLA sets HAVE_TE when its TE extension imports, which it does with a MagicMock `te`
    when TE is absent; then `isinstance(linear_proj, TELinear)` raises: answer False without TE."""
    import importlib.util

    return bool(original) and importlib.util.find_spec("transformer_engine") is not None


def _allow_no_cuda(original):
    """Megatron-LM's `initialize_megatron` asserts `torch.cuda.is_available()` unless its own
    `allow_no_cuda=True` is passed; on the CPU platform pass it (nothing else in the call changes)."""

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _same(original):
    """The target as it is (None where the row created it)."""
    return original


def _no_fused_kernels(_original):
    """Megatron-LM's legacy `fused_kernels.load(args)` probes `$CUDA_HOME/bin/nvcc` (CUDA_HOME is None
    without CUDA) to build CUDA kernels; on CPU there is nothing to build and the eager paths are used."""

    def load(args=None):
        return None

    return load


def _register_all() -> None:
    for name in _FACTORIES:
        register(Patch(f"torch:{name}", _factory, FEATURE, versions=TORCH_SUPPORTED, optional=True))
    tensor_rows = [
        ("Tensor.to", _to), ("Tensor.cuda", _tensor_cuda), ("Tensor.type", _tensor_type),
        ("Tensor.pin_memory", _tensor_pin_memory), ("nn.Module.cuda", _module_cuda),
        ("nn.Module.to", _to),
    ] + [(f"Tensor.{n}", _tensor_new) for n in ("new_empty", "new_zeros", "new_ones", "new_full",
                                                "new_tensor", "new_empty_strided")]
    for attr, build in tensor_rows:
        register(Patch(f"torch:{attr}", build, FEATURE, versions=TORCH_SUPPORTED))
    cuda_rows = [
        ("current_device", _const(0)), ("device_count", _const(1)), ("set_device", _noop),
        ("synchronize", _noop), ("empty_cache", _noop), ("memory_allocated", _const(0)),
        ("max_memory_allocated", _const(0)), ("memory_reserved", _const(0)),
        ("max_memory_reserved", _const(0)), ("reset_peak_memory_stats", _noop),
        ("memory_stats", _memory_stats), ("current_stream", _const(_DEFAULT_STREAM)),
        ("default_stream", _const(_DEFAULT_STREAM)), ("set_stream", _noop),
        ("stream", _stream_ctx), ("Stream", _class(InertStream)), ("Event", _class(InertEvent)),
        ("get_rng_state", _get_rng_state), ("set_rng_state", _set_rng_state),
        ("manual_seed", _manual_seed), ("manual_seed_all", _manual_seed),
        ("random.get_rng_state", _get_rng_state), ("random.set_rng_state", _set_rng_state),
        ("random.manual_seed", _manual_seed), ("random.manual_seed_all", _manual_seed),
        ("nvtx.range_push", _noop), ("nvtx.range_pop", _noop), ("nvtx.mark", _noop),
        ("nvtx.range", _stream_ctx),
    ]
    for attr, build in cuda_rows:
        register(Patch(f"torch:cuda.{attr}", build, FEATURE, versions=TORCH_SUPPORTED))
    register(Patch("torch.distributed:all_gather", _uneven_all_gather, FEATURE, versions=TORCH_SUPPORTED))
    register(Patch("torch.distributed:reduce_scatter", _uneven_reduce_scatter, FEATURE, versions=TORCH_SUPPORTED))
    versions = {"torch": TORCH_SUPPORTED, "megatron-core": MEGATRON_CORE_SUPPORTED,
                "megatron-lm": MEGATRON_LM_SUPPORTED}
    for target, build, optional, key in cpu_parallel.rows():
        register(Patch(target, build, FEATURE, versions=versions[key], optional=optional,
                       description=build.__doc__.strip().splitlines()[0]))
    for target, build, optional, versions in cpu_inference.rows():
        register(Patch(target, build, FEATURE, versions=versions, optional=optional,
                       description=build.__doc__.strip().splitlines()[0]))
    for target, build, optional, gate in mla_local.cpu_rows():
        register(Patch(target, build, FEATURE, versions=gate, optional=optional,
                       description=build.__doc__.strip().splitlines()[0]))
    megatron_rows = [
        ("megatron.core.tensor_parallel.random:_set_cuda_rng_state", _megatron_set_rng_state, False),
        ("megatron.core.tensor_parallel.random:_get_cuda_rng_state", _megatron_get_rng_state, False),
        # the legacy GroupedMLP and its grouped_gemm_util are gone from core_v0.17 (grouped GEMM is TE-only)
        ("megatron.core.transformer.moe.grouped_gemm_util:grouped_gemm",
         _fallback(_GroupedGemmPackage), False, BEFORE_0_17),
        ("megatron.core.transformer.moe.grouped_gemm_util:ops", _fallback(CPUGroupedGemmOps), False,
         BEFORE_0_17),
        ("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu", _host_copy, False),
        ("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu", _host_copy, False),
        ("megatron.core.transformer.multi_latent_attention:HAVE_TE", _te_installed, True),
    ]
    for target, build, optional, *versions in megatron_rows:
        register(Patch(target, build, FEATURE, versions=versions[0] if versions else MEGATRON_CORE_SUPPORTED,
                       optional=optional))
    # moe_utils calls `te_general_gemm` unguarded, a name it imports only from Transformer Engine: defined as None
    # (megatron-core's own "no TE" value) where absent, kept where present
    register(Patch("megatron.core.transformer.moe.moe_utils:te_general_gemm", _same, FEATURE, optional=True,
                   create=True))
    # Megatron-LM training internals (megatron.training / megatron.legacy): only present when a
    # Megatron-LM checkout is on the path, so every row is optional; gated by MEGATRON_LM_SUPPORTED.
    megatron_lm_rows = [
        # `assert torch.cuda.is_available(), "Megatron requires CUDA."` at the top of
        # initialize_megatron: pass Megatron-LM's own allow_no_cuda=True. Both the defining module
        # and training.py's imported name (what `pretrain()` calls) are remapped.
        ("megatron.training.initialize:initialize_megatron", _allow_no_cuda),
        ("megatron.training.training:initialize_megatron", _allow_no_cuda),
        # _compile_dependencies() calls fused_kernels.load(), which shells out to
        # $CUDA_HOME/bin/nvcc; CPU has no CUDA kernels to build -> no-op.
        # megatron.legacy.fused_kernels is gone from core_v0.17 (initialize no longer builds CUDA kernels).
        ("megatron.legacy.fused_kernels:load", _no_fused_kernels, BEFORE_0_17),
    ]
    for target, build, *versions in megatron_lm_rows:
        register(Patch(target, build, FEATURE, versions=versions[0] if versions else MEGATRON_LM_SUPPORTED,
                       optional=True,
                       description=(build.__doc__ or "").strip().splitlines()[0]))
    gates = {"megatron-core": MEGATRON_CORE_SUPPORTED, "megatron-lm": MEGATRON_LM_SUPPORTED}
    for target, build, optional, key in cpu_rl.rows():
        register(Patch(target, build, FEATURE, versions=gates[key], optional=optional,
                       description=build.__doc__.strip().splitlines()[0]))


class _SameGeneratorFilter(logging.Filter):
    """Drops megatron-core's "CPU RNG state changed within GPU RNG context" warning, and only it.

    `CudaRNGStatesTracker.fork()` warns when the CPU generator moved inside a fork of the CUDA one.
    On the CPU platform the "CUDA" generator *is* the CPU generator (rows above), so every random op
    inside a fork (dropout, init) moves it by construction: the warning carries no information here
    and would be printed once per forward of every layer. Nothing else is filtered."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _keep_device_contexts_working() -> None:
    """`with torch.device("meta")` (transformers' from_pretrained, FSDP meta init) injects the device into the
    factories it finds in `torch.utils._device._device_constructors()`, a set cached on its first call. Were that
    first call to come after our wrappers replaced torch.empty & co., the set would hold the wrappers, the
    originals they call would not be recognised, and meta-device tensors would be made as uninitialised CPU
    tensors: compute the set now, before the wrappers exist."""
    try:
        from torch.utils import _device
    except ImportError:  # pragma: no cover - torch without device contexts
        return
    _device._device_constructors()


def install() -> list[str]:
    """Install the transfer-to-CPU layer once; return the targets patched by this call."""
    _keep_device_contexts_working()
    eager_jit.apply()  # first: resolving the rows of this feature imports megatron-core, whose decorators compile
    _register_all()
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    if not any(isinstance(f, _SameGeneratorFilter) for f in logger.filters):
        logger.addFilter(_SameGeneratorFilter())
    return apply_feature(FEATURE)


def uninstall() -> list[str]:
    """Remove the transfer-to-CPU layer: every patched target gets its original back; return the targets."""
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    for f in [f for f in logger.filters if isinstance(f, _SameGeneratorFilter)]:
        logger.removeFilter(f)
    return revert_feature(FEATURE) + eager_jit.revert()
