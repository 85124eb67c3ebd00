"""Run the same samples through one engine per profile, in turn, and aggregate the cells.

One engine is loaded per profile, used for every sample, and closed before the next is loaded
(one model in memory at a time). The samples are built once, with the first engine's tokenizer,
and the same list goes to every profile. Answers are greedy (temperature 0).

A cell is (task, length, profile): the mean score in points (``scoring``), the mean TTFT in
seconds and the mean attention density (``GenerationResult.stats.density``: selected / visible key
blocks over the layers that ran sparse, 1.0 when none did) over the cell's samples. What ran is
taken from the results, not from the profile: a profile whose requested precision did not run
(``GenerationResult.precision`` differs) is labelled with what ran, e.g. ``fp8 (ran bf16)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Callable, Sequence

from flashprefill.dense_layers import DenseLayers, to_data
from fpcli.engine.base import Engine, GenerationResult, precision_family
from fpcli.profiles import Profile, bf16_twin
from fpcli.ruler.scoring import mean_points, sign_test_p, string_match
from fpcli.ruler.tasks import Sample

SCHEMA = "fp.eval/1"


@dataclass
class ProfileRun:
    """What ran for one profile.

    Attributes:
        name: the profile's name; ``attention``, ``requested_precision``: from the profile.
        engine, model: the engine that ran it (``Engine.name``) and the model's display name.
        ran_precision: the attention precision the results report (``GenerationResult.precision``;
            several joined by ``/`` if they differ between samples).
        results: ``{sample id: GenerationResult}``.
        min_sparse_len: the prompt length (tokens) from which the profile runs sparse, as the
            engine fitted it (its ``profile``: ``Profile.fit_to_model``); fitted to the run's context
            (``Profile.fit_to_context``) for an engine that does not say (a resident engine's
            client); ``None`` for a dense profile.
        dense_layers: the profile's dense layers (``Profile.dense_layers``: the first N, or a tuple
            of layer ids; ``None`` for a dense profile): a cell's density is over the other layers
            only. The report writes a tuple as a list.
        bf16_twin: for a profile that asks for an 8-bit precision (``fp8``, ``int8qk``), the name of
            the run's profile that is the same
            at BF16 (``fpcli.profiles.bf16_twin``; ``None`` when none was asked for; set also when
            an interrupted run stopped before the twin answered): ``against_bf16`` pairs their answers.
    """

    name: str
    attention: str
    requested_precision: str
    engine: str = ""
    model: str = ""
    ran_precision: str = ""
    results: dict[str, GenerationResult] = field(default_factory=dict)
    min_sparse_len: int | None = None
    dense_layers: DenseLayers | None = None
    bf16_twin: str | None = None

    @property
    def label(self) -> str:
        """The column title: the name, plus what ran when it is not what the profile asked for."""
        if self.ran_precision and any(precision_family(p) != self.requested_precision
                                      for p in self.ran_precision.split("/")):
            return f"{self.name} (ran {self.ran_precision})"
        return self.name


@dataclass
class EvalRun:
    """All samples and every profile's results (see ``eval_report`` for the JSON form)."""

    samples: list[Sample]
    profiles: list[ProfileRun]
    context_length: int
    interrupted: bool = False  # stopped by Ctrl-C: ``profiles`` holds what finished (the last one partly)


def run_profiles(
    profiles: Sequence,
    open_engine: Callable[[object], Engine],
    build_samples: Callable[[Engine, int], list[Sample]],
    on_message: Callable[[str], None] = lambda m: None,
    on_sample: Callable[[int, int], None] = lambda done, total: None,
) -> EvalRun:
    """Load one engine per profile in turn, answer every sample, close it.

    Args:
        profiles: ``fpcli.profiles.Profile`` objects, names unique.
        open_engine: ``open_engine(profile) -> Engine`` (loaded, not yet entered).
        build_samples: ``build_samples(engine, context_length) -> samples``, called once, with the
            first engine; ``context_length`` = the engine's, capped by every profile's
            ``engine.context_length``.
        on_message: progress lines (engine loads).
        on_sample: ``(done, total)`` after each answer, over all profiles.

    Returns:
        every profile's results; on ``KeyboardInterrupt`` (Ctrl-C) the ones finished so far, with
        ``interrupted`` set (the engine in use is closed; a profile with no answer is left out).

    Raises:
        whatever ``open_engine``, ``build_samples`` or ``Engine.generate`` raise.
    """
    samples: list[Sample] | None = None
    runs: list[ProfileRun] = []
    context = 0
    try:
        for i, prof in enumerate(profiles):
            on_message(f"profile {prof.name} ({i + 1} of {len(profiles)}): loading its engine "
                       "(one engine per profile, closed before the next)")
            eng = open_engine(prof)
            with eng:
                if samples is None:
                    caps = [eng.context_length] + [p.engine.context_length for p in profiles if p.engine.context_length]
                    context = min(caps)
                    samples = build_samples(eng, context)
                run = ProfileRun(prof.name, prof.attention, prof.precision, eng.name, eng.model_name)
                if not prof.is_dense:
                    # as the engine runs it: an in-process engine keeps its fitted profile
                    # (Profile.fit_to_model); a resident engine's client does not
                    ran = getattr(eng, "profile", None)
                    run.min_sparse_len = (ran.sparse.min_sparse_len if isinstance(ran, Profile) and not ran.is_dense
                                          else prof.fit_to_context(context).sparse.min_sparse_len)
                    run.dense_layers = prof.dense_layers
                twin = bf16_twin(prof, profiles)
                run.bf16_twin = twin.name if twin is not None else None
                runs.append(run)
                for s in samples:
                    run.results[s.id] = eng.generate(s.ids, max_new_tokens=s.max_new_tokens, temperature=0.0)
                    run.ran_precision = "/".join(sorted({r.precision for r in run.results.values()}))
                    on_sample(i * len(samples) + len(run.results), len(profiles) * len(samples))
                run.ran_precision = run.ran_precision or eng.precision
    except KeyboardInterrupt:
        return EvalRun(samples or [], [r for r in runs if r.results], context, interrupted=True)
    return EvalRun(samples or [], runs, context)


def cells(run: EvalRun) -> list[dict]:
    """One dict per (task, length, profile), in sample order then profile order: ``score``
    (points 0-100, over every seed's samples), ``score_by_seed`` (``{str(seed): points}``: JSON keys), ``ttft_s``
    and ``density`` (means), ``samples`` (all seeds), ``prompt_tokens`` (mean, rounded to an int), ``min_sparse_len``
    (the profile's, ``None`` for a dense profile) and ``ran_dense``: ``True`` when a sparse profile
    ran no sparse layer on any sample because every prompt was shorter than its ``min_sparse_len``
    (density 1.0: the cell measured dense attention); ``empty_answers``: samples on which the
    engine generated no token (their score of 0 measures nothing about attention)."""
    groups: dict[tuple[str, int], list[Sample]] = {}
    for s in run.samples:
        groups.setdefault((s.task, s.length), []).append(s)
    out = []
    for (task, length), all_group in groups.items():
        for p in run.profiles:
            group = [s for s in all_group if s.id in p.results]  # all, unless interrupted
            if not group:
                continue
            results = [p.results[s.id] for s in group]
            below = p.min_sparse_len is not None and all(s.prompt_tokens < p.min_sparse_len for s in group)
            by_seed: dict[int, list[float]] = {}
            for s, r in zip(group, results):
                by_seed.setdefault(s.seed, []).append(string_match(s.expected, r.text))
            out.append({
                "task": task,
                "length": length,
                "profile": p.name,
                "score": mean_points([string_match(s.expected, r.text) for s, r in zip(group, results)]),
                "score_by_seed": {str(sd): mean_points(v) for sd, v in by_seed.items()},
                "ttft_s": fmean(r.ttft_s for r in results),
                "density": fmean(r.stats.density for r in results),
                "samples": len(group),
                "prompt_tokens": round(fmean(s.prompt_tokens for s in group)),  # an int: tokens
                "min_sparse_len": p.min_sparse_len,
                "ran_dense": below and all(not r.stats.sparse_layers and r.stats.density == 1.0 for r in results),
                "empty_answers": sum(1 for r in results if r.output_tokens == 0),
            })
    return out


def averages(cell_list: Sequence[dict]) -> list[dict]:
    """Per (length, profile): the mean of the task scores (each task weighs the same), TTFT and
    density; ``score_by_seed`` (the same mean over one seed's samples) and ``seed_spread`` (its
    max - min over the seeds, points; 0 with one seed); ``min_sparse_len`` (the profile's) and
    ``ran_dense`` (every task's cell ran dense, see ``cells``: this average measured dense
    attention although the profile is sparse); ``empty_answers`` and ``samples`` (sums over the
    tasks' cells)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for c in cell_list:
        groups.setdefault((c["length"], c["profile"]), []).append(c)
    out = []
    for (length, prof), cs in groups.items():
        seeds = list(dict.fromkeys(sd for c in cs for sd in c["score_by_seed"]))
        by_seed = {sd: fmean(c["score_by_seed"][sd] for c in cs if sd in c["score_by_seed"]) for sd in seeds}
        out.append({"length": length, "profile": prof, "score": fmean(c["score"] for c in cs),
                    "score_by_seed": by_seed, "seed_spread": max(by_seed.values()) - min(by_seed.values()),
                    "ttft_s": fmean(c["ttft_s"] for c in cs), "density": fmean(c["density"] for c in cs),
                    "tasks": len(cs), "min_sparse_len": cs[0].get("min_sparse_len"),
                    "ran_dense": all(c.get("ran_dense", False) for c in cs),
                    "empty_answers": sum(c.get("empty_answers", 0) for c in cs),
                    "samples": sum(c.get("samples", 0) for c in cs)})
    return out


def against_dense(run: EvalRun) -> list[dict]:
    """Every sparse profile's answers against the dense profile's on the same samples (paired:
    the same prompts, so a sample both get right or both get wrong cancels out): per (length,
    profile), in sample then profile order, ``baseline`` (the first profile whose attention is
    dense), ``samples`` (those both answered), ``lost`` / ``won`` (samples it scored below / above
    the baseline; partial credit counts as a score like any other), ``points`` (its mean score
    minus the baseline's over those samples, points 0-100; the difference of their cells when no
    sample is missing), ``sign_p`` (``scoring.sign_test_p`` of ``lost`` / ``won``: how often chance
    alone splits the changed samples this unevenly). Empty when no dense profile ran. ``docs/eval.md``, "Reading the table"."""
    base = next((p for p in run.profiles if p.attention == "dense"), None)
    if base is None:
        return []
    return [row for length in dict.fromkeys(s.length for s in run.samples)
            for p in run.profiles if p.attention != "dense"
            if (row := _paired(run, p, base, length)) is not None]


def against_bf16(run: EvalRun) -> list[dict]:
    """Every 8-bit profile's (``fp8``, ``int8qk``) answers against its BF16 twin's
    (``ProfileRun.bf16_twin``: the same profile at BF16, in the same run) on the same samples: what
    the 8-bit precision alone costs, the sparse settings held fixed (it may select slightly different
    blocks). Per (length, 8-bit profile), the keys of ``against_dense`` (``baseline`` = the twin's
    name), over the samples on which the profile ran its precision (``GenerationResult.precision``):
    where it ran none (every prompt below ``min_sparse_len``, or not available) its answers are its
    twin's by construction and say nothing about the precision. Empty when no 8-bit profile ran its
    precision beside its twin.
    ``docs/eval.md``, "Reading the table"."""
    by_name = {p.name: p for p in run.profiles}
    return [row for length in dict.fromkeys(s.length for s in run.samples)
            for p in run.profiles if p.bf16_twin in by_name
            if (row := _paired(run, p, by_name[p.bf16_twin], length,
                               ran=lambda r, asked=p.requested_precision: precision_family(r.precision) == asked))
            is not None]


def _paired(run: EvalRun, p: ProfileRun, base: ProfileRun, length: int,
            ran: Callable[[GenerationResult], bool] = lambda r: True) -> dict | None:
    """``p`` against ``base`` on the samples of ``length`` both answered (see ``against_dense``)
    and where ``p``'s result passes ``ran``; ``None`` when there are none."""
    pairs = [(string_match(s.expected, p.results[s.id].text), string_match(s.expected, base.results[s.id].text))
             for s in run.samples if s.length == length and s.id in p.results and s.id in base.results
             and ran(p.results[s.id])]
    if not pairs:
        return None
    lost, won = sum(1 for a, b in pairs if a < b), sum(1 for a, b in pairs if a > b)
    return {"length": length, "profile": p.name, "baseline": base.name, "samples": len(pairs),
            "lost": lost, "won": won, "points": 100.0 * fmean(a - b for a, b in pairs),
            "sign_p": sign_test_p(lost, won)}


def eval_report(run: EvalRun, *, seeds: Sequence[int], samples_per_cell: int, tasks: Sequence[str], lengths: Sequence[int],
                haystack: str, profile_sources: dict[str, str | None] | None = None,
                profile_names: Sequence[str] | None = None) -> dict:
    """The ``fp.eval/1`` JSON object.

    Keys: ``schema``, ``model``, ``engine``, ``seed`` (the first seed), ``seeds`` (all of them),
    ``samples_per_cell`` (per seed), ``samples_total``,
    ``tasks``, ``lengths`` (requested, tokens), ``context_length``, ``haystack``, ``profiles``
    (name, label, attention, requested and ran precision, engine, source, dense_layers, bf16_twin), ``cells`` (see
    ``cells``), ``averages`` (see ``averages``), ``against_dense`` (see ``against_dense``), ``against_bf16``
    (see ``against_bf16``) and ``samples``: per sample its id, task, length,
    index, target and prompt tokens, question, expected strings, and per profile name the answer,
    score (0-1), TTFT (s), density, precision that ran, output tokens and finish reason;
    ``interrupted`` (stopped by Ctrl-C: the cells and results hold what finished) and ``missing``
    (see ``missing``: ``profile_names`` are all the profiles requested; empty unless interrupted).
    """
    cell_list = cells(run)
    sources = profile_sources or {}
    seeds = list(seeds)
    return {
        "schema": SCHEMA,
        "model": run.profiles[0].model if run.profiles else None,
        "engine": "/".join(sorted({p.engine for p in run.profiles})) or None,
        "seed": seeds[0],
        "seeds": seeds,
        "samples_per_cell": samples_per_cell,
        "samples_total": len(run.samples),
        "tasks": list(tasks),
        "lengths": list(lengths),
        "context_length": run.context_length,
        "haystack": haystack,
        "profiles": [
            {"name": p.name, "label": p.label, "attention": p.attention, "requested_precision": p.requested_precision,
             "ran_precision": p.ran_precision, "engine": p.engine, "source": sources.get(p.name),
             "dense_layers": None if p.dense_layers is None else to_data(p.dense_layers), "bf16_twin": p.bf16_twin}
            for p in run.profiles
        ],
        "cells": cell_list,
        "averages": averages(cell_list),
        "against_dense": against_dense(run),
        "against_bf16": against_bf16(run),
        "samples": [
            {
                "id": s.id, "task": s.task, "length": s.length, "index": s.index, "seed": s.seed,
                "target_tokens": s.target_tokens, "prompt_tokens": s.prompt_tokens,
                "question": s.question, "expected": list(s.expected),
                "results": {
                    p.name: {
                        "answer": (r := p.results[s.id]).text,
                        "score": string_match(s.expected, r.text),
                        "ttft_s": r.ttft_s,
                        "density": r.stats.density,
                        "precision": r.precision,
                        "output_tokens": r.output_tokens,
                        "finish_reason": r.finish_reason,
                    }
                    for p in run.profiles if s.id in p.results
                },
            }
            for s in run.samples
        ],
        "interrupted": run.interrupted,
        "missing": missing(run, [p for p in profile_names or []]) if run.interrupted else [],
    }


def missing(run: EvalRun, profile_names: Sequence[str]) -> list[dict]:
    """What an interrupted run did not answer: per profile of ``profile_names`` (all requested,
    in order) with unanswered samples, ``{"profile": name, "answered": n, "samples": total}``
    (``samples``: the run's built samples; 0 when it was stopped before they were built)."""
    answered = {p.name: len(p.results) for p in run.profiles}
    total = len(run.samples)
    return [{"profile": n, "answered": answered.get(n, 0), "samples": total}
            for n in profile_names if answered.get(n, 0) < total or total == 0]
