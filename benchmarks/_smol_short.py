"""A shortened copy of SmolLM2-135M-Instruct: its embedding, its first `--layers` decoder layers and its final
norm (tied head), with the real tokenizer and chat template, written once into `build/smollm2-short-<k>/`
(ignored by git) and printed. Only the tensors kept are read from the converted model (safetensors' lazy
`safe_open`), so building it never holds the whole model in memory. A stand-in for speed: its outputs are
not the real model's (the later layers are gone), but its shapes, vocabulary (49,152), tokenizer and
per-layer cost are, which is what the LoRA mix (benchmarks/multiplex_lora.py) and benchmarks/engine_choice.py
need.

    .venv/bin/python benchmarks/_smol_short.py [--layers 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"


def short_copy(layers: int = 2, out: Path | None = None) -> Path:
    """The directory of the `layers`-layer copy, built from the converted model if missing (the conversion
    itself runs first when the model is not converted yet: `plexrl pretrained`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from plexrl.job.pretrained import pretrained_path

    out = out or ROOT / "build" / f"smollm2-short-{layers}"
    if (out / "model.safetensors").is_file():
        return out
    src = pretrained_path(NAME)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers must be 1..{cfg['num_hidden_layers']}, not {layers}")
    cfg["num_hidden_layers"] = layers
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    keep = re.compile(r"model\.layers\.(\d+)\.")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {}
        for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = keep.match(k)
            if m is None or int(m.group(1)) < layers:
                tensors[k] = f.get_tensor(k).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for p in src.iterdir():
        if p.name not in {"model.safetensors", "config.json", "plexrl_pretrained.json"}:
            shutil.copy(p, tmp / p.name)
    tmp.rename(out)  # whole or not at all
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    print(short_copy(args.layers, args.out))


if __name__ == "__main__":
    main()
