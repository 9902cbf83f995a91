"""Function rewards: turn decoded responses into one scalar score per trajectory.

A scoring function has the verl signature

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

and returns either a number or a dict with a "score" key; the dict's other numeric keys (e.g. "acc")
are averaged over the batch and logged as "reward/<key>". Built-in scorers live in `SCORERS`, keyed by
the dataset's `data_source` column; a user file replaces them with `--reward.custom-fn path.py:fn`.
`RewardFn` scores a batch, `token_level_rewards` puts each score on the last response token.

A function that needs to see several responses at once (a judge that ranks a group, a diversity bonus) is
marked with `@batched("group")` or `@batched("batch")` and has verl's batched signature (plural names),
plus the group ids and prompts:

    compute_score(data_sources, solution_strs, ground_truths, extra_infos, groups, prompts) -> list[float | dict]

"group": one call per group (the rows that share a uid: the n responses to one prompt), "batch": one call for
the whole batch; either way it returns one score per response, in the order given.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import re
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

from rlkit.errors import ConfigError, MissingPackage, RunFailed
from rlkit.userfn import load_function  # noqa: F401  (rlkit.rewards.load_function, as before)

logger = logging.getLogger(__name__)

ScoreFn = Callable[..., float | dict]

SCORERS: dict[str, ScoreFn] = {}


def register_scorer(*data_sources: str):
    """Decorator: register a scoring function in `SCORERS` under each given data_source.

    Registering a different function under a name that is already taken raises ValueError
    (re-running the same definition, e.g. in a notebook, is allowed).
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source, e.g. @register_scorer('my/dataset')")

    def decorator(fn: ScoreFn) -> ScoreFn:
        for name in data_sources:
            old = SCORERS.get(name)
            if old is not None and _describe(old) != _describe(fn):
                raise ValueError(f"data_source {name!r} is already scored by {_describe(old)}; pick another name")
            SCORERS[name] = fn
        return fn

    return decorator


# ----------------------------------------------------------------------------- built-in scorers

# verl's gsm8k.py (v0.9.0), re-implemented: only the last 300 characters are searched; "strict" takes the
# last "#### <number>" (exactly one space after ####), "flexible" the last number anywhere that is not ".".
_GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER = re.compile(r"(-?[0-9.,]+)")


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """The answer string verl's gsm8k scorer reads from a response, or None.

    Both methods look at the last 300 characters only.
    strict:   the last match of "#### (-?[0-9.,]+)", with "," removed ("#### 1,234" -> "1234").
              "####18", "#### $18" and "#### 18." (-> "18.") therefore never equal "18".
    flexible: the last match of "(-?[0-9.,]+)" anywhere that is not "." (commas kept: "1,234";
              a sentence-final "18." stays "18.").
    """
    if method not in ("strict", "flexible"):
        raise ConfigError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        matches = _GSM8K_STRICT.findall(text)
        return matches[-1].replace(",", "") if matches else None
    matches = _GSM8K_NUMBER.findall(text)
    valid = [m for m in matches if m != "."]
    if valid:
        return valid[-1]
    return matches[0] if matches else None  # only "." matches: verl's loop ends on the first one


@register_scorer("openai/gsm8k", "gsm8k")
def gsm8k_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """GSM8K as verl scores it (method "strict"): 1.0 if the LAST "#### <number>" in the last 300
    characters equals the ground truth as a string, after removing commas from the answer; else 0.0.

    The ground truth is compared as given (verl's preprocessing already removed its commas).
    See gsm8k_flexible_score for verl's "flexible" method and gsm8k_lenient_score for rlkit's own reading.
    """
    return 1.0 if gsm8k_extract(solution_str, "strict") == str(ground_truth) else 0.0


@register_scorer("rlkit/gsm8k-flexible")
def gsm8k_flexible_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """GSM8K as verl scores it with method "flexible": 1.0 if the last number in the last 300 characters
    (commas kept, "." alone skipped) equals the ground truth as a string. Select it with the data_source
    "rlkit/gsm8k-flexible" or --reward.custom-fn rlkit.rewards:gsm8k_flexible_score.
    """
    return 1.0 if gsm8k_extract(solution_str, "flexible") == str(ground_truth) else 0.0


# rlkit's lenient reading: "#### 1,234." with any spacing; commas and one trailing "." stripped on both sides.
_GSM8K_LENIENT = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d*)?)")


def _normalize_number(text: str) -> str:
    """Drop thousands separators and a trailing full stop: "1,234." -> "1234"."""
    return text.strip().replace(",", "").rstrip(".")


@register_scorer("rlkit/gsm8k-lenient")
def gsm8k_lenient_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """GSM8K, rlkit's lenient reading: 1.0 if the LAST "####<spaces><number>" anywhere in the response equals
    the ground truth once commas and a trailing "." are removed from both ("#### 1,234." matches "1,234").

    More forgiving than verl's strict method ("####72", "#### 72." and a comma'd ground truth score 1.0);
    the comparison is still on strings, so "72.0" does not match "72". No "####" answer scores 0.0.
    """
    answer = gsm8k_lenient_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == _normalize_number(str(ground_truth)) else 0.0


def gsm8k_lenient_answer(solution_str: str) -> str | None:
    """The number of the last "####<spaces><number>", commas and a trailing "." removed ("#### 1,234." -> "1234"), or None."""
    matches = _GSM8K_LENIENT.findall(solution_str)
    return _normalize_number(matches[-1]) if matches else None


@register_scorer("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def math_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MATH: 1.0 if math-verify judges the response's answer equal to the ground truth, else 0.0.

    A ground truth without "$" or "\\boxed" is wrapped in "$...$" so that math-verify parses it as LaTeX.
    math-verify's timeouts use signal.alarm, which only works in the main thread; elsewhere (e.g. a
    thread pool) they are switched off, so a pathological expression can then take arbitrarily long.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise MissingPackage("math_score needs the math-verify package: pip install math-verify") from e

    gold_text = str(ground_truth)
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text, parsing_timeout=seconds)
    answer = parse(solution_str, parsing_timeout=seconds)
    return 1.0 if verify(gold, answer, timeout_seconds=seconds) else 0.0


math_score.sandbox_warm = True  # sandbox workers call it once on an empty answer at start: math-verify's imports


@register_scorer("rlkit/arith")
def arith_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """rlkit's embedded arithmetic task: the whole response (whitespace aside) must be the integer answer."""
    s = 1.0 if solution_str.strip() == str(ground_truth) else 0.0
    return {"score": s, "acc": s}


# A string compare and a regex cannot execute or explode: these run in the trainer unless --reward.sandbox all.
gsm8k_score.in_process = arith_score.in_process = True


def arith_answer(solution_str: str) -> str | None:
    """The embedded task's parsed answer: the response, whitespace aside (None when empty)."""
    return solution_str.strip() or None


# The parsed answer each scorer compares with the ground truth: maj@k votes on it (rlkit/evaluation.py). A scorer of
# your own may carry one too (compute_score.answer = fn); it is read only where the scorer itself runs in-process.
gsm8k_score.answer = functools.partial(gsm8k_extract, method="strict")
gsm8k_flexible_score.answer = functools.partial(gsm8k_extract, method="flexible")
gsm8k_lenient_score.answer = gsm8k_lenient_answer
arith_score.answer = arith_answer


# ----------------------------------------------------------------------------- user functions

BATCHED_LEVELS = ("group", "batch")


def batched(level: str = "group"):
    """Decorator: the function scores a whole group ("group": the rows that share a uid) or the whole batch
    ("batch") in one call, with keyword arguments data_sources, solution_strs, ground_truths, extra_infos, groups,
    prompts (lists, one entry per response) and returns one score (a number or a dict with "score") per response.

    It sets `fn.batched = level`, which RewardFn reads. In the sandbox one call is one job (its time limit is the
    call's); the calls of different groups run in parallel on the sandbox workers.
    """
    if level not in BATCHED_LEVELS:
        raise ConfigError(f"@batched({level!r}): choose 'group' or 'batch'")

    def decorator(fn: ScoreFn) -> ScoreFn:
        fn.batched = level
        return fn

    return decorator


def _calls(fns: list, kwargs: list[dict], groups, prompts) -> list[tuple[list[int], object, dict]]:
    """The scorer calls of a batch: (row indices, function, keyword arguments) in first-row order.

    A per-sample function is called once per row; a @batched one once per group (rows with the same uid; no uid:
    each row its own group) or once per batch, with the plural arguments of those rows in row order.
    """
    calls, index = [], {}
    for i, fn in enumerate(fns):
        level = getattr(fn, "batched", None)
        if level is None:
            calls.append(([i], fn, kwargs[i]))
            continue
        if level not in BATCHED_LEVELS:
            raise ConfigError(f"{_describe(fn)}.batched = {level!r}: set it with @rlkit.rewards.batched('group' or 'batch')")
        key = (id(fn), groups[i] if level == "group" else None)
        if key not in index:
            index[key] = len(calls)
            calls.append(([], fn, None))
        calls[index[key]][0].append(i)
    for c, (rows, fn, kw) in enumerate(calls):
        if kw is None:
            calls[c] = (
                rows,
                fn,
                {
                    "data_sources": [kwargs[i]["data_source"] for i in rows],
                    "solution_strs": [kwargs[i]["solution_str"] for i in rows],
                    "ground_truths": [kwargs[i]["ground_truth"] for i in rows],
                    "extra_infos": [kwargs[i]["extra_info"] for i in rows],
                    "groups": [groups[i] for i in rows],
                    "prompts": [prompts[i] for i in rows],
                },
            )
    return calls


def _split_batched(out, rows: list[int]) -> list:
    """A @batched function's return value as one output per row; ValueError (one line) when the length is wrong."""
    if hasattr(out, "tolist"):  # a tensor or an array
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise ValueError(f"a @batched function must return a list of {len(rows)} scores (one per response), got a {type(out).__name__}")
    if len(out) != len(rows):
        raise ValueError(f"returned {len(out)} scores for {len(rows)} responses; return one score per response, in the order given")
    return list(out)


# ----------------------------------------------------------------------------- batch scoring


def _describe(fn) -> str:
    """'module:qualname' of a function, for error messages."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _as_number(value, what: str) -> float:
    """A finite float from a scorer's output, or ValueError explaining what was wrong with it."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:  # a one-element tensor
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{what} is {value!r} ({type(value).__name__}); expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}; expected a finite number")
    return value


def _parse_output(out) -> tuple[float, dict[str, float]]:
    """Split a scorer's return value into (score, numeric extras); ValueError if it is unusable."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(out)})")
        extras = {  # non-numeric extras (e.g. "pred") are not logged; a NaN/inf one (an "acc" of nan) is an unusable output
            k: _as_number(v, f"dict[{k!r}]") for k, v in out.items() if k != "score" and isinstance(v, numbers.Real)
        }
        return _as_number(out["score"], "dict['score']"), extras
    return _as_number(out, "return value"), {}


@contextmanager
def time_limit(seconds: float | None):
    """Raise TimeoutError in the block after `seconds` (SIGALRM; only on the main thread of a POSIX process,
    elsewhere no limit), marked .time_limit = True (a TimeoutError the scorer raises itself is not). Interrupts Python
    code that loops or sleeps; not a C call that never returns."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        error = TimeoutError(f"no result after {seconds:g} s")
        error.time_limit = True
        raise error

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


DEFAULT_TIMEOUT_S = 30.0  # RewardFn's wall-clock limit per scorer call when none is given (as --reward.timeout-s)


class RewardFn:
    """Scores a batch of decoded responses: one scalar per trajectory.

    Scorers that parse model text with something that can execute or explode (reasoning-gym verifiers,
    math-verify, any --reward.custom-fn) run in a `rlkit.sandbox.SandboxPool`; plain string scorers marked
    `in_process = True` (gsm8k, the embedded arithmetic task) run here, unless sandbox="all".
    """

    def __init__(
        self,
        custom_fn: str | ScoreFn | None = None,
        on_error: str = "raise",
        timeout_s: float | None = None,
        sandbox: str = "auto",
        sandbox_level: str = "process",
        sandbox_workers: int = 0,
        sandbox_fresh: bool = False,
        sandbox_memory_mb: int = 2048,
        stop_if_all_fail: bool = False,
    ):
        """custom_fn: "path.py:fn" (or a callable) used for every data_source; None looks up `SCORERS`.

        on_error: "raise" turns a failing, hanging, exiting or invalid score into a RunFailed naming the function,
        sample and response; "zero" scores such samples 0.0 and counts them in metrics["reward/errors"] (of which
        metrics["reward/timeouts"] ran out of time). timeout_s: wall-clock limit per scorer call (None: DEFAULT_TIMEOUT_S; 0: none).
        sandbox: auto | all | off (off: every scorer in this process, only for code and data you trust).
        sandbox_level: the least isolation to accept (rlkit.sandbox.LEVELS); sandbox_workers: 0 = one per core (at most 8);
        sandbox_fresh: a new process for every call. stop_if_all_fail (on for a run: from_config): with on_error="zero", a
        batch on which every call failed raises RunFailed naming the function and the first error (a scorer broken for
        every sample would otherwise score all 0 and train nothing, silently).
        """
        if on_error not in ("raise", "zero"):
            raise ConfigError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if sandbox not in ("auto", "all", "off"):
            raise ConfigError(f"--reward.sandbox {sandbox!r}: choose auto, all or off")
        self.spec = custom_fn if isinstance(custom_fn, str) else None
        if custom_fn is None or callable(custom_fn):
            self.custom_fn = custom_fn
        else:
            self.custom_fn = load_function(custom_fn)
        self.on_error = on_error
        self.stop_if_all_fail = stop_if_all_fail
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s  # finite unless 0 is asked for
        self.sandbox, self.sandbox_level, self.sandbox_fresh, self.sandbox_memory_mb = (
            sandbox,
            sandbox_level,
            sandbox_fresh,
            sandbox_memory_mb,
        )
        self.sandbox_workers = sandbox_workers or min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8)
        self.pool = None
        self.model, self.use_function = None, True  # a RewardModel, set by from_config

    @classmethod
    def from_config(cls, cfg, device: str = "auto", model=None, max_length: int = 2048, system=None) -> RewardFn:
        """The reward of a RewardConfig and its RewardSystem (where scorers run, what a failing one does; default
        RewardSystem()): the scoring function and, with cfg.model_path, a reward model (loaded here on `device`, reading
        at most `max_length` tokens, unless `model` gives one: anything called as model(prompts, responses))."""
        from rlkit.config import RewardSystem

        s = system or RewardSystem()
        fn = cls(
            cfg.custom_fn,
            s.on_error,
            s.timeout_s,
            s.sandbox,
            s.sandbox_level,
            s.sandbox_workers,
            s.sandbox_fresh,
            s.sandbox_memory_mb,
            stop_if_all_fail=True,
        )
        if cfg.model_path:
            from rlkit.reward_model import RewardModel

            fn.model = model or RewardModel(cfg.model_path, device, s.model_micro_batch_size, max_length)
            fn.use_function = cfg.combine == "add"
        return fn

    def scorer_for(self, data_source: str) -> ScoreFn:
        """The function that scores `data_source`: the custom one if given, else the registered one."""
        if self.custom_fn is not None:
            return self.custom_fn
        if data_source not in SCORERS:
            raise ConfigError(
                f"no reward function for data_source {data_source!r}; registered: {', '.join(sorted(SCORERS))}. "
                "Write your own compute_score(data_source, solution_str, ground_truth, extra_info=None) "
                "and pass --reward.custom-fn path.py:fn"
            )
        return SCORERS[data_source]

    def sandbox_spec(self, fn) -> str | None:
        """How a sandbox worker imports `fn`, or None when `fn` runs in this process."""
        if self.sandbox == "off" or (self.sandbox == "auto" and getattr(fn, "in_process", False)):
            return None
        if fn is self.custom_fn and self.spec:
            return self.spec
        from rlkit.sandbox import function_spec

        try:
            return function_spec(fn)
        except ConfigError:
            if self.sandbox == "all":
                raise
            if _describe(fn) not in _warned:
                _warned.add(_describe(fn))
                logger.warning(
                    "reward function %s is not importable by name (a lambda or a local function): it runs in-process", _describe(fn)
                )
            return None

    def _pool(self, jobs: list[dict], fns: list):
        """The sandbox pool, its workers warmed up on each (function, data_source) of `jobs` with an empty response
        (so a verifier's lazy imports and parsed task are ready in every fork); restarted when new ones appear."""
        from rlkit.sandbox import Limits, SandboxPool

        warm = {}
        for job, fn in zip(jobs, fns):
            key = (job["fn"], str(job["kwargs"].get("data_source", "")))  # (a @batched job has data_sources)
            if getattr(fn, "sandbox_warm", False):  # built-in verifiers only: never call a user's function for nothing
                warm.setdefault(key, {"fn": job["fn"], "kwargs": {**job["kwargs"], "solution_str": ""}})
            else:
                warm.setdefault(key, None)
        if self.pool is not None and not set(warm) <= self._warm_keys:
            warm = {**self._warm, **warm}
            self.close()
        if self.pool is None:
            limits = Limits(timeout_s=self.timeout_s or 86400.0, memory_mb=self.sandbox_memory_mb)
            self._warm, self._warm_keys = warm, set(warm)
            self.pool = SandboxPool(
                limits,
                self.sandbox_workers,
                preload=sorted({fn for fn, _ in warm}),
                warm=[job for job in warm.values() if job is not None],
                min_level=self.sandbox_level,
                fresh=self.sandbox_fresh,
            )
        return self.pool

    def close(self) -> None:
        """Stop the sandbox workers (they also stop when this object is garbage-collected or the process exits) and a
        reward model's Ray workers, if any (one in this process goes with this object)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if hasattr(self.model, "close"):
            self.model.close()

    def __call__(self, data_sources, responses: list[str], ground_truths, extra_infos=None, prompts=None, groups=None):
        """Score B responses; returns (float32 tensor of shape (B,), metrics dict of floats).

        `data_sources` may be one string for the whole batch. Scorers are called with keyword arguments,
        as verl does; a @batched one once per group of `groups` (the uids, e.g. batch["uid"]; None: each row
        its own group) or once per batch. Metrics: "reward/<key>" = mean of each extra numeric key returned by dict scorers
        (over the samples that returned it), and "reward/errors", "reward/timeouts" when on_error="zero".
        """
        n = len(responses)
        if isinstance(data_sources, str):
            data_sources = [data_sources] * n
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"batch length mismatch: {len(data_sources)} data_sources, {n} responses, "
                f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos"
            )

        model_scores = None
        if self.model is not None:  # model-based reward: its score, alone or added to the function's
            if prompts is None:
                raise ValueError("a reward model needs the prompts: call reward_fn(..., prompts=batch['raw_prompt'])")
            model_scores = self.model(prompts, responses)
            if not self.use_function:
                return model_scores, {"reward/model_score": model_scores.mean().item()}
        fns = [self.scorer_for(data_sources[i]) for i in range(n)]
        kwargs = [
            {"data_source": data_sources[i], "solution_str": responses[i], "ground_truth": ground_truths[i], "extra_info": extra_infos[i]}
            for i in range(n)
        ]
        groups = list(groups.tolist() if hasattr(groups, "tolist") else groups) if groups is not None else list(range(n))
        calls = _calls(fns, kwargs, groups, list(prompts) if prompts is not None else [None] * n)  # [(rows, fn, kwargs)]
        specs = [self.sandbox_spec(fn) for _, fn, _ in calls]
        boxed = [c for c in range(len(calls)) if specs[c] is not None]
        jobs = [{"fn": specs[c], "kwargs": calls[c][2]} for c in boxed]
        pool = self._pool(jobs, [calls[c][1] for c in boxed]) if boxed else None
        results = dict(zip(boxed, pool.map(jobs, fail_fast=self.on_error == "raise"))) if boxed else {}  # call -> its Result
        skipped = {i for c, r in results.items() if r is None for i in calls[c][0]}  # not run: the run stops on a failure
        outs, failures, timeouts = [None] * n, {}, 0  # outs: row -> the function's output; failures: row -> exception
        for c, (rows, fn, kw) in enumerate(calls):
            try:
                if c in results:
                    r = results[c]
                    if r is None:
                        continue
                    if not r.ok:
                        timeouts += r.timed_out * len(rows)
                        raise ScorerFailed(f"{r.error} (in the sandbox)")
                    out = r.value
                else:
                    with time_limit(self.timeout_s if fn is self.custom_fn else None):
                        out = fn(**kw)
                for i, o in zip(rows, _split_batched(out, rows) if getattr(fn, "batched", None) else [out]):
                    outs[i] = o
            except (Exception, SystemExit) as e:  # SystemExit: a scorer's sys.exit() must not end the run with status 0
                failures.update({i: e for i in rows})
                timeouts += getattr(e, "time_limit", False) * len(rows)  # in the trainer (the sandbox's: r.timed_out above)
        scores, extras, errors = [], {}, []
        for i in range(n):
            try:
                if i in skipped:
                    continue
                if i in failures:
                    raise failures[i]
                score, sample_extras = _parse_output(outs[i])
            except (Exception, SystemExit) as e:
                response = str(responses[i])
                short = response if len(response) <= 200 else response[:200] + "..."
                why = str(e) if isinstance(e, ScorerFailed) else f"{type(e).__name__}: {e}"
                message = (
                    f"reward function {_describe(fns[i])} failed on sample {i} (data_source={data_sources[i]!r}, response={short!r}): {why}"
                )
                if self.on_error == "raise":
                    raise RunFailed(message + " - fix the function, or score such samples 0 with --reward.on-error zero") from e
                errors.append(message)
                score, sample_extras = 0.0, {}
            scores.append(score)
            for k, v in sample_extras.items():
                extras.setdefault(k, []).append(v)

        metrics = {f"reward/{k}": sum(v) / len(v) for k, v in extras.items()}
        if self.on_error == "zero":
            metrics["reward/errors"] = float(len(errors))
            metrics["reward/timeouts"] = float(timeouts)
            if errors and len(errors) == n and self.stop_if_all_fail:
                first = " ".join(errors[0].split())  # one line
                raise RunFailed(
                    f"every one of the {n} reward calls of this batch failed (--reward.on-error zero would score them all 0 and train "
                    f"nothing); the first: {first} - fix the function"
                )
            if errors:
                logger.warning("%d/%d reward calls failed and scored 0.0; first: %s", len(errors), n, errors[0])
        import torch  # here, not at the top: sandbox workers import this module and never need torch

        scores = torch.tensor(scores, dtype=torch.float32)
        if model_scores is not None:
            metrics["reward/model_score"] = model_scores.mean().item()
            scores = scores + model_scores
        return scores, metrics


class ScorerFailed(RuntimeError):
    """A sandboxed scorer call that returned no value (raised, timed out, crashed or exited)."""


_warned: set[str] = set()


def token_level_rewards(scores, response_mask):
    """(B,) scores -> (B, T) zeros with each score on its row's last valid response token.

    For the usual right-padded mask that token is at index mask.sum(-1) - 1 (verl's convention);
    taking the last 1 in the mask also handles masks with holes. A row with no valid token stays zero.
    """
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must have shape (B,) = ({response_mask.shape[0]},), got {tuple(scores.shape)}")
    import torch

    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    out = torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device)
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(out.device, dtype)[rows]
    return out
