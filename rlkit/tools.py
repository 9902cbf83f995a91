"""Tools for multi-turn rollouts: plain Python functions, the call format, and the two shipped tools.

A tool is a Python function with type hints and a Google-style docstring (an `Args:` line per
argument). transformers' `get_json_schema` turns it into the JSON schema that chat templates
render (`apply_chat_template(messages, tools=[...])`)::

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: e.g. "123*456"
        '''

`Tools([calculator, python])` holds them by name and runs a call; a tool that raises, crashes, gets bad
arguments, is unknown or times out returns an error *text* for the model (and counts as an error),
never an exception.

The call format is Qwen2.5 / Hermes, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
parsed by `parse_hermes`: the one place to swap for another format (pass `parse=` to the turn loop).
A chat template without tool support (its render ignores `tools=`) gets the tools described in the
system message, `DEFAULT_TOOL_PROMPT`, in the same Hermes format.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# ----------------------------------------------------------------------------- the call format


@dataclass
class ToolCall:
    """One parsed call; `error` is set when the call text was malformed (the model is told so)."""

    name: str
    arguments: dict
    error: str | None = None


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 32_768  # a call's JSON text longer than this is malformed (a python tool's program fits many times over)
MAX_JSON_DEPTH = 32  # [ and { nested deeper than this are malformed (json's C parser recurses: ~1000 levels raise RecursionError)


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, brackets inside strings (and escaped quotes) ignored: one linear scan."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def bounded_json(text: str, what: str = "the call"):
    """json.loads(text) after the size and depth checks; ValueError (with the limit's name) when over one."""
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"{what} is {len(text)} characters, over rlkit.tools.MAX_CALL_CHARS = {MAX_CALL_CHARS}")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests [ and {{ {depth} deep, over rlkit.tools.MAX_JSON_DEPTH = {MAX_JSON_DEPTH}")
    return json.loads(text)


def tool_call_bodies(text: str) -> list[str]:
    """The text between each <tool_call> and the first </tool_call> after it, left to right (what the regex
    <tool_call>(.*?)</tool_call> finds, in one linear pass: a text of many unclosed tags costs no more than its length)."""
    bodies, pos = [], 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:  # no closing tag after this one: none after any later opening tag either
            break
        bodies.append(text[start + len(TOOL_CALL_OPEN) : end])
        pos = end + len(TOOL_CALL_CLOSE)
    return bodies


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in one assistant turn, in order.

    The JSON must be an object with "name" (str) and "arguments" (an object, or a JSON string of
    one), at most MAX_CALL_CHARS characters and MAX_JSON_DEPTH levels of [ / { deep. A malformed call
    becomes ToolCall(error=...), so that the model reads what went wrong (and it counts in
    agent/tool_errors); no model text makes this raise. A tag left open is not a call (the turn is the answer).
    """
    calls = []
    for body in tool_call_bodies(text):
        try:
            obj = bounded_json(body)
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):
                args = bounded_json(args, "its 'arguments' string")
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("'name' must be a string and 'arguments' an object")
            calls.append(ToolCall(name, args))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # (RecursionError: never, given the depth limit)
            calls.append(ToolCall("", {}, error=f"malformed tool call ({type(e).__name__}: {str(e)[:200]})"))
    return calls


DEFAULT_TOOL_PROMPT = (
    "You can call tools. Their signatures, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    'To call one, reply with <tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>; '
    "the result comes back as a tool message."
)


def render_prompt(tokenizer, messages: list[dict], schemas: list[dict]) -> str:
    """The prompt text of `messages` with `schemas` offered as tools, ending in the generation prompt.

    A template that renders `tools=` (Qwen2.5, Llama 3.1, Hermes, ...) does so; one that ignores it
    gets DEFAULT_TOOL_PROMPT as (the start of) the system message.
    """
    messages = list(messages)
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not schemas:
        return plain
    with_tools = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    if with_tools != plain:
        return with_tools
    text = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": text + "\n\n" + messages[0]["content"]}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ----------------------------------------------------------------------------- the registry


@dataclass
class ToolResult:
    text: str  # what the model reads (truncated)
    error: bool  # raised, bad arguments, unknown tool, malformed call, or timed out
    timed_out: bool
    seconds: float


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep both ends of a long text (verl truncates tool output in the middle too)."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return text[:head] + "\n...(truncated)...\n" + text[len(text) - (max_chars - head) :]


class ToolTimeout(Exception):
    """Raised by a tool whose work ran past its time limit (the python tool does)."""


class Tools:
    """Tools by name: `schemas` for the chat template, `call(ToolCall)` -> ToolResult (never raises), and
    `call_many(calls)`, which runs the calls of sandboxed tools (those with a `sandbox_job`, the python tool)
    at once across a pool of sandbox workers (`sandbox_workers`, 0 = one per core, at most 8), the others
    here, results in order. `sandbox_level`: the least isolation those tools may run under (rlkit.sandbox.LEVELS)."""

    def __init__(self, fns: list, max_chars: int = 256, sandbox_level: str = "process", sandbox_workers: int = 0):
        from transformers.utils import get_json_schema

        self.fns = {fn.__name__: fn for fn in fns}
        self.schemas = [get_json_schema(fn) for fn in fns]
        self.max_chars = max_chars
        self.sandbox_level, self.sandbox_workers = sandbox_level, sandbox_workers
        self._pools: dict = {}  # tool name -> its SandboxPool, started at the first call

    def __len__(self) -> int:
        return len(self.fns)

    def __getstate__(self):  # (sent to Ray workers: each starts its own sandbox workers)
        return {**self.__dict__, "_pools": {}}

    def close(self) -> None:
        """Stop the sandbox workers (they also stop with this object, and with this process)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def call(self, call: ToolCall) -> ToolResult:
        return self.call_many([call])[0]

    def call_many(self, calls: list[ToolCall]) -> list[ToolResult]:
        """A ToolResult per call, in order; the sandboxed tools' calls all at once (one pool.map per tool)."""
        results: list[ToolResult | None] = [None] * len(calls)
        jobs: dict = {}  # tool name -> [(index, job)]
        for i, c in enumerate(calls):
            fn = None if c.error else self.fns.get(c.name)
            if fn is None or not hasattr(fn, "sandbox_job"):
                results[i] = self._call_here(c)
                continue
            try:
                jobs.setdefault(c.name, []).append((i, fn.sandbox_job(**c.arguments)))
            except Exception as e:  # bad arguments
                results[i] = self._result(f"error: {type(e).__name__}: {e}", True, False, 0.0)
        for name, todo in jobs.items():
            fn = self.fns[name]
            for (i, _), res in zip(todo, self._pool(name).map([job for _, job in todo])):
                try:
                    results[i] = self._result(str(fn.sandbox_text(res)), False, False, res.seconds)
                except ToolTimeout as e:
                    results[i] = self._result(f"error: timed out ({e})", True, True, res.seconds)
                except Exception as e:
                    results[i] = self._result(f"error: {type(e).__name__}: {e}", True, False, res.seconds)
        return results

    def _pool(self, name: str):
        if name not in self._pools:
            from rlkit.sandbox import Limits, SandboxPool

            workers = self.sandbox_workers or min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8)
            limits = Limits(**self.fns[name].sandbox_limits())
            self._pools[name] = SandboxPool(limits, workers, min_level=self.sandbox_level, flag="--agent.sandbox-level")
        return self._pools[name]

    def _result(self, text: str, error: bool, timed_out: bool, seconds: float) -> ToolResult:
        return ToolResult(truncate_middle(text, self.max_chars), error, timed_out, seconds)

    def _call_here(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        timed_out = False
        if call.error:
            text, error = f"error: {call.error}", True
        elif call.name not in self.fns:
            text, error = f"error: unknown tool {call.name!r}; available: {', '.join(self.fns)}", True
        else:
            try:
                text, error = str(self.fns[call.name](**call.arguments)), False
            except ToolTimeout as e:
                text, error, timed_out = f"error: timed out ({e})", True, True
            except Exception as e:  # the model's input broke the tool: tell the model, keep the run going
                text, error = f"error: {type(e).__name__}: {e}", True
        return self._result(text, error, timed_out, time.perf_counter() - start)


# ----------------------------------------------------------------------------- calculator

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_INT_BITS = 1024


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > MAX_INT_BITS:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "123*456" or "(2+3)**2".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    out = _eval(ast.parse(expression.strip(), mode="eval").body)  # a parse and a whitelisted walk: no eval()
    if isinstance(out, float) and out.is_integer():
        out = int(out)
    return str(out)


# ----------------------------------------------------------------------------- python


# Runs in the child before the user code: resource limits, then the code itself (no preexec_fn, which is
# unsafe in a threaded parent). argv: code, cpu seconds, memory MiB, max output bytes.
_LAUNCHER = """
import resource, sys
code, cpu, mem, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem << 20, mem << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
del resource, sys, cpu, mem, out
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def run_code_subprocess(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 1 << 16) -> tuple[str, str, bool]:
    """Run Python `code` in a fresh isolated interpreter: (stdout, stderr, timed_out).

    `python -I` (no PYTHON* variables, no user site) with an empty environment, in a temporary
    working directory deleted afterwards, in its own session (the whole process group is killed at
    the wall-clock limit); RLIMIT_CPU, RLIMIT_AS (memory_mb) and RLIMIT_FSIZE (output files, so that
    stdout/stderr, written to files, stay under max_output bytes). This limits resources; it is not
    isolation from the file system or the network.
    """
    with tempfile.TemporaryDirectory(prefix="rlkit-tool-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        cpu = max(1, int(timeout_s + 0.999))
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER, code, str(cpu), str(memory_mb), str(max_output)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=work,
                env={},
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                timed_out = True
        read = lambda p: open(p, "rb").read(max_output).decode("utf-8", "replace")  # noqa: E731
        return read(out_path), read(err_path), timed_out


def run_code(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> tuple[str, str, bool]:
    """Run Python `code` with limits: (stdout, stderr, timed_out).

    Uses the hardened sandbox, `rlkit.sandbox.Sandbox(Limits(...)).run_code(code)` (one fresh sandboxed
    worker per call), when that module is installed; else run_code_subprocess.
    """
    if importlib.util.find_spec("rlkit.sandbox") is not None:
        from rlkit import sandbox

        with sandbox.Sandbox(sandbox.Limits(timeout_s=timeout_s, memory_mb=memory_mb, output_bytes=1 << 16)) as box:
            res = box.run_code(code)
        return res.stdout, res.stderr, res.timed_out
    return run_code_subprocess(code, timeout_s, memory_mb)


PYTHON_TIMEOUT_S = 5.0


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout, then stderr).

    Args:
        code: The program; print the values you need.
    """
    stdout, stderr, timed_out = run_code(code, PYTHON_TIMEOUT_S)
    return _python_text(stdout, stderr, timed_out)


def _python_text(stdout: str, stderr: str, timed_out: bool, crash: str = "") -> str:
    if timed_out:
        raise ToolTimeout(f"over {PYTHON_TIMEOUT_S:g} s")
    if crash:  # killed by a signal, or its sandbox worker died or sent garbage: a tool error (agent/tool_errors)
        raise RuntimeError(crash)
    return stdout + (("\nstderr:\n" + stderr) if stderr else "")


# How Tools runs the python tool: as a job of its sandbox pool (rlkit.sandbox), many calls at once.
python.sandbox_job = lambda code: {"code": code}
python.sandbox_text = lambda res: _python_text(res.stdout, res.stderr, res.timed_out, res.error if res.status == "crash" else "")
python.sandbox_limits = lambda: {"timeout_s": PYTHON_TIMEOUT_S, "memory_mb": 512, "output_bytes": 1 << 16}

BUILTIN = {"calculator": calculator, "python": python}


def tools_from_names(names: str, max_chars: int = 256, sandbox_level: str = "process", flag: str = "--agent.tools") -> Tools:
    """Tools("calculator,python") from the shipped ones, by name (--agent.tools). With the python tool, a
    --agent.sandbox-level this machine cannot give stops here, before anything loads (one line)."""
    from rlkit.errors import ConfigError

    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BUILTIN]
    if unknown:
        raise ConfigError(f"{flag}: unknown tool(s) {', '.join(unknown)}; available: {', '.join(BUILTIN)}")
    if "python" in wanted:
        from rlkit.sandbox import check_level

        check_level(sandbox_level, "--agent.sandbox-level")
    return Tools([BUILTIN[n] for n in wanted], max_chars, sandbox_level)
