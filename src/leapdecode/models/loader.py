"""Load a Hugging Face-format model directory into a backend."""

from __future__ import annotations

import logging
import os

import torch

from ..errors import LeapDecodeError
from .base import CausalLM

log = logging.getLogger("leapdecode")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
BACKENDS = ("native", "transformers")


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LeapDecodeError(f"unknown device {device!r}: use cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LeapDecodeError(
            "CUDA is not available on this machine: use --device cpu"
            + (" (LEAPDECODE_DEVICE asks for cuda)" if os.environ.get("LEAPDECODE_DEVICE") else "")
        )
    if dev.type not in ("cpu", "cuda"):
        raise LeapDecodeError(f"unsupported device {device!r}: use cpu or cuda")
    return dev


def cpu_has_fast_bf16() -> bool:
    """Does this CPU compute in bfloat16 natively (AVX-512 BF16, AMX)? Elsewhere oneDNN
    emulates it: measured on an AVX2-only EPYC, a bf16 training step ran about 20x slower
    than float32."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_description() -> str:
    """The CPU's vector capability as torch sees it, and whether bfloat16 is native: machines
    of one kind differ (an AVX2-only EPYC emulates bfloat16), and a timing says which ran it."""
    bf16 = "native bfloat16" if cpu_has_fast_bf16() else "bfloat16 emulated"
    return f"{torch.backends.cpu.get_cpu_capability()}, {bf16}"


def resolve_dtype(dtype: str | torch.dtype, config=None) -> torch.dtype:
    """A torch dtype from a name; "auto" is the checkpoint's own (config.json `dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = DTYPES.get(saved)
        return saved if saved in DTYPES.values() else torch.float32
    if dtype not in DTYPES:
        raise LeapDecodeError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def check_model_dir(path: str, what: str = "model") -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LeapDecodeError(
            f"{what} path {path!r} does not exist: pass a Hugging Face model folder"
        )
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise LeapDecodeError(
            f"{what} path {path!r} is not a Hugging Face model folder (no config.json): "
            "pass the folder that holds config.json and the *.safetensors weights"
        )
    return path


def load_config(path: str):
    from transformers import AutoConfig

    from .heads import ARCH_KINDS, architecture

    try:  # a speculator folder given as a model: say what it is and where it goes
        arch = architecture(path)
    except LeapDecodeError:
        arch = ""  # transformers says what is wrong with it
    if arch in ARCH_KINDS:
        kind = {"MedusaHeads": "Medusa heads", "Eagle3Head": "an EAGLE head"}.get(
            arch, "a parallel EAGLE head"
        )
        raise LeapDecodeError(
            f"{path!r} holds {kind}, not a language model: pass it with "
            "--speculator PATH (API: speculators=[PATH])"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise LeapDecodeError(f"cannot read the model config in {path!r}: {e}") from e


def load_model(
    path: str,
    backend: str = "native",
    device: str = "cpu",
    dtype: str = "float32",
    what: str = "model",
    quantize: str | None = None,
) -> CausalLM:
    """Load a model folder with the native backend (falling back to transformers) or
    transformers; quantize: None, "int8" or "int4" (weight-only, native backend only)."""
    if backend not in BACKENDS:
        raise LeapDecodeError(f"unknown backend {backend!r}: use native or transformers")
    if quantize and backend != "native":
        raise LeapDecodeError("--quantize runs on the native backend: leave out --backend")
    path = check_model_dir(path, what)
    dev = resolve_device(device)
    config = load_config(path)
    dt = resolve_dtype(dtype, config)
    if backend == "native":
        from .llama import NativeLlama, NativeUnsupported

        try:
            return NativeLlama(path, config, dev, dt, quantize)
        except NativeUnsupported as e:
            if quantize:
                raise LeapDecodeError(
                    f"--quantize runs on the native backend, which cannot run {path!r} ({e}): "
                    "leave --quantize out"
                ) from None
            log.warning("native backend cannot run %s (%s); falling back to transformers", path, e)
    from .hf import TransformersLM

    try:
        return TransformersLM(path, config, dev, dt)
    except LeapDecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, SafetensorError, ...
        raise LeapDecodeError(
            f"cannot load the model in {path!r} ({type(e).__name__}: {e}): check that its "
            "weight files are complete"
        ) from None
