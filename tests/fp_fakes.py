"""Test helpers shared by the CPU tests (imported as ``fp_fakes``; ``tests/`` is on ``sys.path``).

A module with a unique name, not ``conftest``: ``tests/gpu/conftest.py`` also exists, and
``from conftest import ...`` would pick whichever conftest was imported first.

``FakeEngine`` implements ``fpcli.engine.base.Engine`` with a whitespace tokenizer: one token per
whitespace-separated word, plus ``TEMPLATE_TOKENS`` for the chat template. It streams a scripted
answer and reports synthetic ``PrefillStats``. Use it directly, through the ``fake_engine``
fixture of ``tests/conftest.py`` (which routes ``fpcli.engine.load_engine`` to it), or from a
subprocess with ``FP_ENGINE_FACTORY=fp_fakes:fake_load_engine`` and ``tests/`` on ``PYTHONPATH``.
``FakeSGLangEngine`` (made by ``fake_sglang``) stands in for ``SGLangEngine`` in ``fp bench --e2e``.
``make_pdf``, ``make_tex_pdf`` (words placed one by one, as TeX does), ``make_tex_accent_pdf`` (accent
glyphs drawn over their letters, as TeX does), ``encrypt_pdf`` and
``garble_pdf`` build real PDFs for the ingestion tests. ``invoke`` runs the CLI in this process.
"""
from __future__ import annotations

import io
import re
import time
from typing import Callable

from fpcli.engine.base import GenerationResult, PrefillStats, eight_bit, precision_family, ran_precision

TEMPLATE_TOKENS = 7  # tokens the fake chat template adds around system + user


class FakeEngine:
    """A deterministic stand-in for a loaded model.

    Args:
        answer: the text ``generate`` streams (a ``{fact}`` placeholder is filled with the first
            "secret code is X" sentence found in the prompt, to test end-to-end plumbing).
        context_length: max positions (prompt + answer).
        num_layers, num_kv_heads: shape of the synthetic density statistics.
        profile: the profile name to report.
    """

    name = "fake"
    precision = "bf16"  # the model dtype; fake_load_engine sets "fp8 (sparse layers)" for an FP8 profile, as the real engines do
    start_s = 0.01  # started in this process (a resident engine reports 0.0)
    min_sparse_len = 0  # prompts shorter than this run every layer dense, as the engines do below a profile's min_sparse_len

    def __init__(
        self,
        answer: str = "The answer is 42.",
        context_length: int = 4096,
        num_layers: int = 4,
        num_kv_heads: int = 2,
        profile: str = "bf16",
        model_name: str = "fake-model",
    ) -> None:
        self.answer = answer
        self.context_length = context_length
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.profile = profile
        self.model_name = model_name
        self.model_path = None  # no tokenizer files: prompt fits are not cached
        self.prompts: list[tuple[str | None, str]] = []  # (system, user) of every encode_chat call
        self.generated: list[dict] = []  # arguments of every generate call
        self.closed = False

    # -- Engine contract -------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def token_starts(self, text: str) -> list[int]:
        return [m.start() for m in re.finditer(r"\S+", text)]

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        self.prompts.append((system, user))
        words = (system or "").split() + user.split()
        return [1] * TEMPLATE_TOKENS + [hash(w) % 50000 + 2 for w in words]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_cached: Callable[[int], None] | None = None,  # no KV cache kept: never called, like SGLang
    ) -> GenerationResult:
        if len(prompt_ids) + max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the context "
                f"length {self.context_length}"
            )
        self.generated.append({"prompt_len": len(prompt_ids), "max_new_tokens": max_new_tokens, "temperature": temperature})
        t0 = time.perf_counter()
        for layer in range(self.num_layers) if on_progress else ():
            on_progress(layer + 1, self.num_layers)
        text = self.answer
        if "{fact}" in text:
            user = self.prompts[-1][1] if self.prompts else ""
            m = re.search(r"secret code is (\w+)", user)
            text = text.replace("{fact}", m.group(1) if m else "unknown")
        pieces = re.findall(r"\S+\s*", text)[:max_new_tokens]
        ttft = None
        for piece in pieces:
            if ttft is None:
                ttft = time.perf_counter() - t0 + 0.010
            if on_text:
                on_text(piece)
        total = time.perf_counter() - t0 + 0.050
        return GenerationResult(
            text="".join(pieces),
            prompt_tokens=len(prompt_ids),
            output_tokens=len(pieces),
            ttft_s=ttft or total,
            prefill_s=(ttft or total) * 0.9,
            total_s=total,
            engine=self.name,
            model=self.model_name,
            profile=self.profile,
            stats=self.stats_for(len(prompt_ids)),
            finish_reason="stop" if len(pieces) < max_new_tokens else "length",
            precision=self.precision,
        )

    def stats_for(self, n: int) -> PrefillStats:
        """Synthetic statistics: layer 0 dense, deeper layers sparser, heads differ a little;
        computed like the real engines (overall density over the sparse layers 1..; skipped FLOPs
        over all layers, the dense layer skipping none). The ``dense`` profile: all dense, no index."""
        flops_per_layer = 4.0 * n * n / 2 * 64 * self.num_kv_heads
        if self.profile == "dense" or n < self.min_sparse_len:
            return PrefillStats(
                density=1.0,
                density_per_layer=[1.0] * self.num_layers,
                density_per_layer_head=[[1.0] * self.num_kv_heads for _ in range(self.num_layers)],
                attention_flops_dense=flops_per_layer * self.num_layers,
                attention_ms=6.0,
            )
        per_head = []
        for layer in range(self.num_layers):
            base = 1.0 if layer == 0 else max(0.05, 0.6 / layer)
            per_head.append([round(min(1.0, base * (1.0 + 0.1 * h)), 4) for h in range(self.num_kv_heads)])
        per_layer = [sum(row) / len(row) for row in per_head]
        sparse = list(range(1, self.num_layers))
        overall = sum(per_layer[i] for i in sparse) / len(sparse)
        return PrefillStats(
            density=overall,
            density_per_layer=per_layer,
            density_per_layer_head=per_head,
            sparse_layers=sparse,
            attention_flops_dense=flops_per_layer * self.num_layers,
            attention_flops_skipped=sum(flops_per_layer * (1.0 - per_layer[i]) for i in sparse),
            index_ms=1.5,
            attention_ms=6.0,
            index_ms_per_layer=[0.5] * len(sparse),      # as the real engines: one per sparse layer,
            attention_ms_per_layer=[2.0] * len(sparse),  # summing to the totals
        )

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> "FakeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fp_executable() -> str:
    """The installed ``fp`` entry point (beside this Python, else on ``PATH``)."""
    import shutil
    import sys
    from pathlib import Path

    import pytest

    exe = Path(sys.executable).with_name("fp")
    found = str(exe) if exe.exists() else shutil.which("fp")
    if not found:
        pytest.fail("the `fp` entry point is not installed (pip install -e .)")
    return found


def run_env() -> dict:
    """The environment for ``fp`` subprocesses that run the real model."""
    import os

    env = dict(os.environ)
    # Idle OpenMP threads sleep instead of spinning: on a shared or busy CPU, spinning threads
    # slow torch down by an order of magnitude (measured: 1K-token prefill 18 s -> 4.6 s).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def invoke(runner, args: list[str], **kw):
    """``fp ARGS`` in this process through a Typer ``CliRunner`` (the ``runner`` fixture), at 200
    columns so that help and tables do not wrap; ``env=`` adds variables (``COLUMNS`` included),
    other keywords (``input=``) go to ``runner.invoke``. Returns its ``Result``."""
    from fpcli.cli import app

    env = {"COLUMNS": "200", **kw.pop("env", {})}
    return runner.invoke(app, args, env=env, **kw)


class FakeSGLangEngine:
    """Stands in for ``fpcli.engine.sglang_engine.SGLangEngine`` where ``fpcli.ttft.run_ttft_bench``
    starts one engine per profile (``fake_sglang`` makes the class). The same constructor
    (``model_path, profile``, keywords), public methods and public attributes as the real class,
    and no others (``tests/test_ttft.py`` checks both against it); results as the real engine reports
    them: a ``GenerationResult`` on ``cuda`` whose ``precision`` is ``"fp8 (sparse layers)"`` only
    when an FP8 profile's prompt reaches its ``min_sparse_len`` (the sparse layers ran; else the
    model's ``bf16``), with ``dense_prefill_stats`` for a dense profile and ``PrefillStats`` over
    the sparse layers otherwise (density 1.0 below ``min_sparse_len``, where no layer runs sparse).

    Tokens: one per whitespace-separated word after ``TEMPLATE_TOKENS``; a number (``12345.``) is
    the id ``_NUMBER_ID + 12345``, so an engine that did not build the prompt reads the needle back:
    the answer is the prompt's first number, unless the profile's name is in ``_miss``. A radix
    cache like SGLang's: the same ids again without ``flush_cache`` are served from the cache
    (``cached_tokens``) and only the rest is prefilled. TTFT: ``_ttft_per_1k[profile name]`` seconds
    per 1024 prefilled tokens (no clock)."""

    name = "sglang"
    _NUMBER_ID = 100_000
    _LAYERS, _Q_HEADS, _KV_HEADS, _HEAD_DIM = 4, 4, 2, 64
    _ttft_per_1k: dict = {}
    _miss: tuple = ()
    _started: list = []  # (model_path, profile) of every engine started, in order
    _calls: list = []  # ("flush",) / ("generate", profile name, ids) of every engine, in order

    def __init__(self, model_path, profile, **kwargs) -> None:
        self.model_path = str(model_path)
        self.model_name = str(model_path).rstrip("/").rsplit("/", 1)[-1]
        self.profile = profile
        self.profile_name = profile.name
        self.sparse = not profile.is_dense
        self.model_precision = "bf16"
        self.precision = ran_precision(self.model_precision, int(self.sparse and eight_bit(profile.precision)),
                                       profile.precision)
        self.context_length = int(profile.engine.context_length or 32768)
        self.start_s = self.warmup_s = 0.0
        self._cache: list[int] | None = None
        self._closed = False
        self._started.append((self.model_path, profile))

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def token_starts(self, text: str) -> list[int]:
        return [m.start() for m in re.finditer(r"\S+", text)]

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        words = (system or "").split() + user.split()
        ids = []
        for w in words:
            number = w.strip(".,:;")
            ids.append(self._NUMBER_ID + int(number) if number.isdigit() else hash(w) % 50000 + 2)
        return [1] * TEMPLATE_TOKENS + ids

    def generate(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, on_text=None,
                 on_progress=None, on_cached=None, *, top_p: float = 1.0, top_k: int = -1,
                 rid: str | None = None) -> GenerationResult:
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        ids = [int(x) for x in prompt_ids]
        if len(ids) + max_new_tokens > self.context_length:
            raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} exceeds the context {self.context_length}")
        self._calls.append(("generate", self.profile_name, ids))
        cached = len(ids) - 1 if self._cache == ids else 0  # SGLang prefills at least the last token
        self._cache = ids
        n = len(ids)
        ttft = self._ttft_per_1k.get(self.profile_name, 1.0) * (n - cached) / 1024
        numbers = [str(i - self._NUMBER_ID) for i in ids if i >= self._NUMBER_ID]
        text = "I do not know." if self.profile_name in self._miss or not numbers else numbers[0]
        text = " ".join(text.split()[:max_new_tokens])
        if on_text is not None:
            on_text(text)
        from fpcli.engine.base import dense_prefill_stats

        sparse_ran = self.sparse and n - cached >= self.profile.sparse.min_sparse_len
        if not self.sparse:
            stats = dense_prefill_stats(n, self._LAYERS, self._Q_HEADS, self._KV_HEADS, self._HEAD_DIM)
        elif sparse_ran:
            layers = [i for i in range(self._LAYERS) if not self.profile.dense_layer(i)]
            per_layer = [1.0 if i not in layers else 0.4 for i in range(self._LAYERS)]
            stats = PrefillStats(density=0.4, density_per_layer=per_layer, sparse_layers=layers)
        else:
            stats = PrefillStats(density=1.0, density_per_layer=[1.0] * self._LAYERS)
        return GenerationResult(
            text=text, prompt_tokens=n, output_tokens=len(text.split()), ttft_s=ttft, prefill_s=ttft,
            total_s=ttft + 0.01, engine=self.name, model=self.model_name, profile=self.profile_name, stats=stats,
            finish_reason="stop", precision=ran_precision(self.model_precision, int(sparse_ran and eight_bit(self.precision)),
                                                          precision_family(self.precision)),
            device="cuda", cached_tokens=cached,
        )

    def flush_cache(self, timeout_s: float = 3.0) -> bool:
        self._calls.append(("flush",))
        self._cache = None
        return True

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "FakeSGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fake_sglang(ttft_per_1k: dict | None = None, miss: tuple = ()) -> type:
    """A ``FakeSGLangEngine`` class of its own (its own ``_started`` and ``_calls`` logs) with the
    TTFT per 1024 prefilled tokens of each profile name (default 1 s) and the profiles that miss
    the needle."""
    return type("FakeSGLangEngine", (FakeSGLangEngine,), {"_ttft_per_1k": dict(ttft_per_1k or {}),
                                                          "_miss": tuple(miss), "_started": [], "_calls": []})


LAST_FAKE: list[FakeEngine] = []  # engines made by fake_load_engine, newest last


def fake_load_engine(engine: str = "auto", model: str | None = None, profile=None, progress=None, **kwargs) -> FakeEngine:
    """Drop-in for ``fpcli.engine.load_engine``; also the ``FP_ENGINE_FACTORY`` hook for subprocess
    tests. ``$FP_FAKE_ANSWER`` and ``$FP_FAKE_CONTEXT`` set the answer and the context length,
    ``$FP_FAKE_LOAD_S`` a slow load (seconds)."""
    import os

    time.sleep(float(os.environ.get("FP_FAKE_LOAD_S", "0")))

    fake = FakeEngine(
        answer=os.environ.get("FP_FAKE_ANSWER", "The answer is 42."),
        context_length=int(os.environ.get("FP_FAKE_CONTEXT", "4096")),
        profile=getattr(profile, "name", str(profile)),
        model_name=model or "fake-model",
    )
    fake.requested = {"engine": engine, "model": model, "profile": profile}
    fake.load_kwargs = dict(kwargs)  # what the command asked of the loader (max_requests, warmup, ...)
    if eight_bit(getattr(profile, "precision", "bf16")) and not getattr(profile, "is_dense", False):
        fake.precision = ran_precision("bf16", 1, profile.precision)  # like the real engines: in the sparse layers
    engine_settings = getattr(profile, "engine", None)
    if engine_settings is not None:  # like the real engines: the profile's context, YaRN beyond the native one
        from fpcli.engine.context import plan_context

        fake.context_plan = plan_context({"max_position_embeddings": fake.context_length},
                                         engine_settings.context_length, model=fake.model_name)
        fake.context_length = fake.context_plan.context
    LAST_FAKE.append(fake)
    return fake


# -- PDF builders (reportlab) --------------------------------------------------------------------


def _saved(c, buf, path) -> bytes:
    """The bytes of reportlab canvas ``c`` (written into ``buf``), also written to ``path`` if given."""
    c.save()
    data = buf.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


def make_pdf(pages: list[str | None], path=None, producer: str | None = None) -> bytes:
    """A real PDF with one page per entry: a string is drawn as text lines; ``None`` makes an
    image-only page (no text layer, like a scan); ``""`` a blank page (nothing drawn). ``producer``:
    the document information's Producer (``None``: ReportLab's own). Written to ``path`` when given."""
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf)
    if producer is not None:
        c.setProducer(producer)
    for content in pages:
        if content is None:
            c.drawImage(ImageReader(_scan_image()), 72, 300, width=400, height=400)
        elif content:
            y = 760
            for line in content.splitlines():
                c.drawString(72, y, line)
                y -= 14
        c.showPage()
    return _saved(c, buf, path)


def make_tex_pdf(
    pages: list[str], path=None, style: str = "td", gap: int = 333, space_width: int | None = None
) -> bytes:
    """A PDF whose words are placed the way TeX's PDF writers place them: no space glyph between
    words, each word positioned on its own. ``style``: ``td`` (a relative ``Td`` move before every
    word, as xdvipdfmx writes), ``tm`` (an absolute text matrix per word) or ``tj`` (one ``TJ``
    array per line with a kerning offset of ``-gap`` for each space, as pdfTeX writes).
    ``gap``: the space between words in 1/1000 em (TeX's interword glue: 333 natural, down to
    222 on a line squeezed to its shrink limit). ``space_width``: when given, the font carries
    ``/FirstChar 32 /Widths`` with this width (1/1000 em) for code 32 although no space is ever
    drawn, as pdfTeX copies every code's width from the TeX font metrics (Latin Modern: 500);
    ``None``: a standard font without ``/Widths`` (Times-Roman's own space, 250).
    Each page's text is wrapped at 80 characters (Times-Roman 10pt). Written to ``path`` when given."""
    import textwrap

    from reportlab.pdfbase.pdfmetrics import stringWidth
    from reportlab.pdfgen import canvas

    font, size, leading = "Times-Roman", 10, 13
    space = size * gap / 1000
    buf = io.BytesIO()
    c = canvas.Canvas(buf)
    for content in pages:
        c.setFont(font, size)  # registers the font on this page
        lines = [line for para in content.split("\n") for line in textwrap.wrap(para, 80)]
        if style == "tj":
            fname = c._doc.getInternalFontName(font)
            for i, line in enumerate(lines):
                words = f"-{gap}".join(f"({_pdf_escape(w)})" for w in line.split())
                c.addLiteral(f"BT {fname} {size} Tf 72 {760 - i * leading} Td [{words}] TJ ET")
        else:
            t = c.beginText()
            t.setFont(font, size)
            for i, line in enumerate(lines):
                x, y = 72.0, 760.0 - i * leading
                prev_w = 0.0  # the width of the word before (set after each word; read from the second on)
                t.setTextOrigin(x, y)
                for j, word in enumerate(line.split()):
                    if j and style == "tm":
                        t.setTextOrigin(x, y)
                    elif j:
                        t.moveCursor(prev_w + space, 0)
                    t.textOut(word)
                    prev_w = stringWidth(word, font, size)
                    x += prev_w + space
            c.drawText(t)
        c.showPage()
    c.save()
    data = buf.getvalue()
    if space_width is not None:
        data = _with_widths(data, space_width)
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


def make_tex_accent_pdf(pieces: list, path=None, producer: str = "pdfTeX-1.40.25",
                        creator: str | None = "LaTeX with hyperref") -> bytes:
    """A one-line PDF whose accented letters are drawn the way TeX draws them: the spacing accent
    glyph first, raised a little over the letter's box, then the letter at the same x (two glyphs,
    no composed character). ``pieces``: strings drawn as they are, and ``(accent, letter)`` pairs,
    e.g. ``["Br", ("\u00a8", "o"), "ker"]``; Times-Roman (WinAnsi: ¨ ´ ˆ ˜ ¸ ¯ and the letters).
    ``producer`` and ``creator``: the document information's Producer and Creator (``None``:
    ReportLab's defaults); the default names pdfTeX and LaTeX, as a pdflatex run does.
    Written to ``path`` when given."""
    from reportlab.pdfbase.pdfmetrics import stringWidth
    from reportlab.pdfgen import canvas

    font, size = "Times-Roman", 10
    buf = io.BytesIO()
    c = canvas.Canvas(buf)
    if producer is not None:
        c.setProducer(producer)
    if creator is not None:
        c.setCreator(creator)
    t = c.beginText()
    t.setFont(font, size)
    x, y = 72.0, 760.0
    for piece in pieces:
        accent, text = piece if isinstance(piece, tuple) else (None, piece)
        if accent is not None:
            t.setTextOrigin(x, y + 0.5)
            t.textOut(accent)
        t.setTextOrigin(x, y)
        t.textOut(text)
        x += stringWidth(text, font, size)
    c.drawText(t)
    c.showPage()
    return _saved(c, buf, path)


def _with_widths(data: bytes, space_width: int) -> bytes:
    """``data`` with ``/FirstChar 32 /LastChar 255 /Widths`` on every font: Times-Roman's widths
    (WinAnsi codes), except ``space_width`` for code 32."""
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import ArrayObject, NameObject, NumberObject
    from reportlab.pdfbase.pdfmetrics import getFont

    widths = [space_width] + list(getFont("Times-Roman").widths[33:256])
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    for page in writer.pages:
        for name in page["/Resources"]["/Font"]:
            f = page["/Resources"]["/Font"][name].get_object()
            f[NameObject("/FirstChar")] = NumberObject(32)
            f[NameObject("/LastChar")] = NumberObject(255)
            f[NameObject("/Widths")] = ArrayObject(NumberObject(w) for w in widths)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def _pdf_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def encrypt_pdf(data: bytes, user_password: str, path, algorithm: str = "RC4-128") -> None:
    """Write ``data`` encrypted with ``algorithm`` (pypdf's names: ``RC4-128``, ``AES-128``,
    ``AES-256``; AES needs the cryptography package, which ``pypdf[crypto]`` brings)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm=algorithm)
    with open(path, "wb") as f:
        writer.write(f)


def _scan_image():
    """A small grey-noise PIL image standing in for a scanned page."""
    from PIL import Image

    img = Image.new("L", (64, 64))
    img.putdata([(x * 7 + y * 13) % 256 for y in range(64) for x in range(64)])
    return img


_PUA_CMAP = b"""/CIDInit /ProcSet findresource begin
12 dict begin
begincmap
/CMapName /Garble def
/CMapType 2 def
1 begincodespacerange
<00> <FF>
endcodespacerange
1 beginbfrange
<20> <7E> <E020>
endbfrange
endcmap
CMapName currentdict /CMap defineresource pop
end
end
"""


def garble_pdf(data: bytes) -> bytes:
    """``data`` with a ToUnicode map on every font that sends each character to the private-use
    area (U+E020...), as PDFs with broken font encodings do: the text extracts as gibberish."""
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import DecodedStreamObject, NameObject

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    for page in writer.pages:
        fonts = page["/Resources"]["/Font"]
        for name in fonts:
            stream = DecodedStreamObject()
            stream.set_data(_PUA_CMAP)
            fonts[name].get_object()[NameObject("/ToUnicode")] = writer._add_object(stream)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def noisy_load_engine(*args, **kwargs) -> FakeEngine:
    """``fake_load_engine`` that first writes what real libraries write while a model loads: a
    transformers logger warning, an SGLang logger warning and a Python ``UserWarning`` (the
    ``FP_ENGINE_FACTORY`` hook of the quiet-terminal tests)."""
    import logging
    import warnings

    logging.getLogger("transformers.modeling_utils").warning("THIRD-PARTY transformers warning")
    logging.getLogger("sglang.srt.model_executor").warning("THIRD-PARTY sglang warning")
    warnings.warn("THIRD-PARTY python warning", UserWarning, stacklevel=1)
    return fake_load_engine(*args, **kwargs)
