"""A heads folder on disk (Medusa, EAGLE-3): config.json and float32 safetensors, written
whole and read with a clear error. Apart from heads.py (which finds and loads heads of
every kind) so that each kind's module can read and write its folder without importing the
loader that imports it."""

from __future__ import annotations

import json
import os

from ..errors import LeapDecodeError

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def write_folder(out: str, state: dict, config: dict) -> None:
    """A heads folder: the weights as float32 safetensors (buffers such as d2t as given)
    and config.json."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    # each file written whole, then moved in place: a killed write leaves the old folder
    weights, cfg = os.path.join(out, WEIGHTS), os.path.join(out, CONFIG)
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        weights + ".tmp",
        metadata={"format": "pt"},
    )
    with open(cfg + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(weights + ".tmp", weights)
    os.replace(cfg + ".tmp", cfg)


def read_folder(path: str, what: str, kind: str) -> tuple[dict, dict]:
    """(config, weights) of a heads folder; a clear error where it is not one."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_path) or not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise LeapDecodeError(
            f"{path!r} is not {what} folder (config.json + model.safetensors): "
            f"train one with `leapdecode train {kind}`"
        )
    try:
        with open(cfg_path) as f:
            config = json.load(f)
        weights = load_file(os.path.join(path, WEIGHTS))
    except Exception as e:  # noqa: BLE001 - bad JSON, a truncated safetensors (SafetensorError)
        raise LeapDecodeError(
            f"{path!r} could not be read ({e}): retrain it with `leapdecode train {kind}`"
        ) from None
    if not isinstance(config, dict):
        raise LeapDecodeError(
            f"{cfg_path} is not a JSON object: retrain with `leapdecode train {kind}`"
        )
    return config, weights
