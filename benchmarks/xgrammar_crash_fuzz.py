"""Crash fuzz of the grammar engine: random constraints that pass ``kvflow.structured.validate``
must compile and run in xgrammar without killing the process.

xgrammar is C++: a bad input can end the whole engine process (a signal, no Python exception),
hang the grammar worker thread, or eat the machine's memory. Each case is a random constraint of
one kind (``grammar``: GBNF with rule references, cycles, self-references, * + ? {m} {m,}
{m,n} {,n}, character classes plain / negated / Unicode, empty strings, nested groups,
lookaheads, counts up to thousands; ``regex``: nested quantifiers, large bounded repeats,
Unicode and negated classes, escapes, lazy quantifiers, alternation; ``json``: nested objects,
$ref recursion through $defs, anyOf / oneOf / single allOf, patterns, min/maxLength,
min/maxItems, prefixItems, enum / const, numeric bounds, formats; ``choice``). In a child
process of a pool (restarted when one dies) each case goes through what the server does
(``validate``), and when it passes, through the engine's compile (``XgrammarBackend.compile``)
for a small 24-token vocabulary or, for one case in four, the real SmolLM2 tokenizer (49152
tokens), then a ``GrammarMatcher`` runs up to 16 steps (``fill_next_token_bitmask``, accept a
random allowed token, now and then a rollback). The child has ``RLIMIT_AS`` of its size after
start-up plus 4 GiB, and each case a wall-clock limit (``--case-timeout``, 10 s).

A death (signal or exit), a timeout or a memory error is an incident; the first few of each
(kind, outcome) are shrunk (rules, alternatives, characters, keys deleted, counts halved,
while the same outcome recurs) and printed as minimal reproducers with the stage they hit
(validate / compile / matcher). A timeout is confirmed with 6x the limit before it counts.

    flock /work/notes/bench.lock env PYTHONPATH=. .venv/bin/python \\
        benchmarks/xgrammar_crash_fuzz.py --seed 0 --minutes 12 --workers 2

Prints one line per incident, then a summary (cases per kind, refused by validate, compiled,
incidents by class); writes the incidents as JSON to ``--out`` when given. Exit status 1 when
any incident was found.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import sys
import time
from collections import Counter
from multiprocessing.connection import wait

SMOLLM2 = "/work/main/out/smollm2-hf"
SMALL_VOCAB = ["a", "b", "c", "x", "ab", "abc", "{", "}", '"', ":", ",", "0", "1", "-", " ",
               "\n", "[", "]", "é", "中", "😀", "true", "null", "</s>"]
KINDS = ("grammar", "regex", "json", "choice")
MEMORY_HEADROOM = 4 << 30  # bytes of address space a child may add to its start-up size
SLOW_COMPILE_S = 3.0  # a compile this long holds one of the engine's compile threads (and a
# core) for seconds; past --structured-output-compile-timeout its request fails
SLOW_FILL_S = 0.2  # a bitmask fill this long stalls the step loop (it runs in it)


# --------------------------------------------------------------------------- generators
def _count(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 3, 5, rng.randint(0, 20), rng.randint(100, 140),
                       rng.randint(120, 300), rng.randint(500, 3000)])


def _quantifier(rng: random.Random, allow_open_low: bool) -> str:
    m, n = sorted((_count(rng), _count(rng)))
    forms = ["*", "+", "?", f"{{{m}}}", f"{{{m},}}", f"{{{m},{n}}}"]
    if allow_open_low:
        forms.append(f"{{,{n}}}")
    return rng.choice(forms)


_GBNF_STRINGS = ['"a"', '"ab"', '""', '"\\n"', '"é"', '"中文"', '"\\""', '"x"', '"\\u00e9"',
                 '"\\U0001F600"', '"\\t"', '"{"']
_GBNF_CLASSES = ["[a-z]", "[^a]", "[^\\n]", "[\\u00e9-\\u00ff]", "[\\U0001F600-\\U0001F64F]",
                 "[0-9a-fA-F]", "[^\\\"\\\\]", "[a]", "[^\\x00-\\x7f]", "[ -~]", "[\\x00-\\x1f]",
                 "[中-龥]", "[^\\U0001F600]"]


def _gbnf_expr(rng: random.Random, names: list[str], depth: int) -> str:
    alts = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        seq = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            roll = rng.random()
            if roll < 0.25:
                atom = rng.choice(_GBNF_STRINGS)
            elif roll < 0.45:
                atom = rng.choice(_GBNF_CLASSES)
            elif roll < 0.75 or depth > 2:
                atom = rng.choice(names)
            else:
                atom = f"({_gbnf_expr(rng, names, depth + 1)})"
            if rng.random() < 0.4:
                atom += _quantifier(rng, allow_open_low=False)
            seq.append(atom)
        alts.append(" ".join(seq))
    return " | ".join(alts)


def gen_grammar(rng: random.Random) -> str:
    names = ["root"] + [f"r{i}" for i in range(rng.randint(0, 5))]
    lines = []
    for name in names:
        body = _gbnf_expr(rng, names, 0)
        if rng.random() < 0.1:
            body = f"{body} (= {rng.choice(_GBNF_STRINGS + _GBNF_CLASSES)})"  # lookahead
        lines.append(f"{name} ::= {body}")
    return "\n".join(lines)


_REGEX_ATOMS = ["a", "b", "ab", ".", "\\d", "\\w", "\\s", "\\D", "\\W", "\\S", "[a-z]", "[^a]",
                "[\\u00e9-\\u00ff]", "[^\\n]", "é", "中", "😀", "\\.", "\\u00e9", "[\\w-]",
                "[0-9a-f]", "[^\\x00-\\x7f]", "\\n", "\\t", "[\\s\\S]", "\\\\", "\\\""]


def _regex(rng: random.Random, depth: int) -> str:
    alts = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        seq = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.3 and depth < 3:
                atom = rng.choice(["(", "(?:"]) + _regex(rng, depth + 1) + ")"
            else:
                atom = rng.choice(_REGEX_ATOMS)
            if rng.random() < 0.45:
                atom += _quantifier(rng, allow_open_low=False)
                if rng.random() < 0.1:
                    atom += "?"  # lazy
            seq.append(atom)
        alts.append("".join(seq))
    return "|".join(alts)


def gen_regex(rng: random.Random) -> str:
    body = _regex(rng, 0)
    if rng.random() < 0.3:
        body = "^" + body + "$"
    return body


def _schema(rng: random.Random, depth: int, defs: list[str]) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "any"]
    if depth < 3:
        kinds += ["object", "object", "array", "array", "anyOf", "oneOf", "allOf"]
    if defs:
        kinds += ["ref", "ref"]
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict = {"type": rng.choice(["string", "string", ["string", "null"]])}
        if rng.random() < 0.4:
            s["minLength"] = _count(rng)
        if rng.random() < 0.4:
            s["maxLength"] = max(s.get("minLength", 0), _count(rng))
        if rng.random() < 0.3:
            s["pattern"] = gen_regex(rng)
        if rng.random() < 0.1:
            s["format"] = rng.choice(["date", "date-time", "email", "uuid", "ipv4", "uri"])
        return s
    if kind in ("integer", "number"):
        s = {"type": kind}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if rng.random() < 0.25:
                s[key] = rng.choice([0, -1, 7, 10**rng.randint(1, 18), -(10**rng.randint(1, 18)),
                                     1.5, rng.randint(-1000, 1000)])
        return s
    if kind == "enum":
        return {"enum": rng.sample(["a", "", "中", 1, 2.5, None, True, [1], {"k": "v"},
                                    "x" * rng.randint(0, 300)], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["a", 0, None, {"k": [1, 2]}, "é\n"])}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "any":
        return rng.choice([{}, {"type": ["integer", "string"]}, {"description": "x"}])
    if kind == "object":
        props = {rng.choice(["a", "b", "c", "é", "k k", ""]) + str(i): _schema(rng, depth + 1, defs)
                 for i in range(rng.randint(0, 4))}
        s = {"type": "object", "properties": props}
        if props and rng.random() < 0.6:
            s["required"] = rng.sample(list(props), rng.randint(1, len(props)))
        if rng.random() < 0.5:
            s["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
        if rng.random() < 0.15:
            s["minProperties"], s["maxProperties"] = sorted((_count(rng), _count(rng)))
        if rng.random() < 0.1:
            s["patternProperties"] = {gen_regex(rng): {"type": "string"}}
        return s
    if kind == "array":
        s = {"type": "array", "items": _schema(rng, depth + 1, defs)}
        if rng.random() < 0.4:
            s["minItems"] = _count(rng)
        if rng.random() < 0.4:
            s["maxItems"] = max(s.get("minItems", 0), _count(rng))
        if rng.random() < 0.2:
            s["prefixItems"] = [_schema(rng, depth + 1, defs) for _ in range(rng.randint(1, 3))]
        return s
    if kind in ("anyOf", "oneOf"):
        return {kind: [_schema(rng, depth + 1, defs) for _ in range(rng.randint(1, 3))]}
    if kind == "allOf":
        return {"allOf": [_schema(rng, depth + 1, defs)]}
    return {"$ref": f"#/$defs/{rng.choice(defs)}"}


def gen_json(rng: random.Random) -> str:
    defs = [f"d{i}" for i in range(rng.choice([0, 0, 1, 2]))]
    schema = _schema(rng, 0, defs)
    if defs and isinstance(schema, dict):
        schema["$defs"] = {name: _schema(rng, 1, defs) for name in defs}  # may recurse
    return json.dumps(schema, ensure_ascii=False)


def gen_choice(rng: random.Random) -> str:
    pool = ["a", "ab", "中文", "😀", "\n", '"', "\\", "x" * rng.randint(1, 2000), "é" * 50]
    return json.dumps(rng.sample(pool, rng.randint(1, 5)), ensure_ascii=False)


GENERATORS = {"grammar": gen_grammar, "regex": gen_regex, "json": gen_json, "choice": gen_choice}


# --------------------------------------------------------------------------- the child
def _params(kind: str, spec: str):
    from kvflow.structured import StructuredOutputsParams
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec))
    return StructuredOutputsParams(**{kind: spec})


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _backends():
    import transformers
    import xgrammar as xgr

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    def make(info):
        backend = XgrammarBackend.__new__(XgrammarBackend)
        backend.vocab_size = info.vocab_size
        backend._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return backend

    small = xgr.TokenizerInfo(SMALL_VOCAB, stop_token_ids=[len(SMALL_VOCAB) - 1])
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    big = xgr.TokenizerInfo.from_huggingface(tok, stop_token_ids=[tok.eos_token_id])
    return {"small": make(small), "smollm2": make(big)}


def _run_matcher(backend, compiled, rng: random.Random) -> tuple[int, float]:
    import torch
    import xgrammar as xgr
    matcher = backend.new_matcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    ids = torch.arange(backend.vocab_size)
    steps, slowest = 0, 0.0
    for _ in range(16):
        if matcher.is_terminated():
            break
        began = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        slowest = max(slowest, time.perf_counter() - began)
        allowed = ((bitmask[0][ids // 32] >> (ids % 32)) & 1).nonzero().flatten().tolist()
        if not allowed:
            break
        if not matcher.accept_tokens([rng.choice(allowed)]):
            raise AssertionError("the matcher refused a token its bitmask allowed")
        steps += 1
        if steps > 2 and rng.random() < 0.15:
            matcher.rollback(1)
            steps -= 1
    return steps, slowest


def child_main(conn, stage) -> None:
    """Serve cases from ``conn``: (kind, spec, vocab, seed) -> (status, detail)."""
    from kvflow.structured import validate
    backends = _backends()
    limit = _vm_bytes() + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", ""))
    while True:
        kind, spec, vocab, seed = conn.recv()
        stage.value = 1
        try:
            params = _params(kind, spec)
            validate(params)
        except ValueError as e:
            conn.send(("refused", str(e)[:200]))
            continue
        except MemoryError:
            conn.send(("memory", "validate"))
            continue
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            conn.send(("error", f"validate {type(e).__name__}: {str(e)[:200]}"))
            continue
        try:
            stage.value = 2
            began = time.perf_counter()
            compiled = backends[vocab].compile(params)
            compile_s = time.perf_counter() - began
            stage.value = 3
            steps, fill_s = _run_matcher(backends[vocab], compiled, random.Random(seed))
            slow = compile_s > SLOW_COMPILE_S or fill_s > SLOW_FILL_S
            timing = (f"compile {compile_s:.2f} s, slowest bitmask fill {fill_s:.3f} s, "
                      f"{steps} steps")
            conn.send(("slow" if slow else "ok", timing))
        except MemoryError:
            conn.send(("memory", ["", "validate", "compile", "matcher"][stage.value]))
        except Exception as e:  # noqa: BLE001
            text = str(e)
            status = "memory" if "bad_alloc" in text else "error"
            where = ["", "validate", "compile", "matcher"][stage.value]
            conn.send((status, f"{where} {type(e).__name__}: {text[:200]}"))


# --------------------------------------------------------------------------- the pool
STAGES = ["idle", "validate", "compile", "matcher"]


class Worker:
    """One child process and its pipe; ``case`` is what it is running (None when idle)."""

    def __init__(self, ctx) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.stage = ctx.Value("i", 0)
        self.proc = ctx.Process(target=child_main, args=(child_conn, self.stage), daemon=True)
        self.proc.start()
        child_conn.close()
        if not self.conn.poll(300) or self.conn.recv()[0] != "ready":
            raise RuntimeError("a fuzz worker did not start")
        self.case = None
        self.deadline = 0.0

    def submit(self, case: tuple, timeout_s: float) -> None:
        self.case, self.deadline = case, time.monotonic() + timeout_s
        self.stage.value = 0
        self.conn.send(case)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


class Pool:
    def __init__(self, n: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.workers = [Worker(self.ctx) for _ in range(n)]

    def collect(self) -> list[tuple]:
        """Wait for at least one busy worker to answer, die or time out; (case, status,
        detail) for each that did. A worker that died or timed out is replaced after every
        worker's answer is read (a replacement's start-up takes seconds, which must not count
        against the other workers' cases)."""
        busy = [w for w in self.workers if w.case is not None]
        until = min(w.deadline for w in busy)
        wait([w.conn for w in busy] + [w.proc.sentinel for w in busy],
             timeout=max(0.0, until - time.monotonic()))
        done, dead = [], []
        for i, w in enumerate(self.workers):
            if w.case is None:
                continue
            status = detail = None
            if w.conn.poll():
                try:
                    status, detail = w.conn.recv()
                except EOFError:
                    pass
            if status is None and not w.proc.is_alive():
                w.proc.join(5)
                status, detail = "died", f"{STAGES[w.stage.value]} exit {w.proc.exitcode}"
            elif status is None and time.monotonic() >= w.deadline:
                status, detail = "timeout", STAGES[w.stage.value]
            if status is None:
                continue
            done.append((w.case, status, detail))
            w.case = None
            if status in ("died", "timeout"):
                dead.append(i)
        for i in dead:
            self.workers[i].stop()
            self.workers[i] = Worker(self.ctx)
        return done

    def run_one(self, case: tuple, timeout_s: float) -> tuple[str, str]:
        """Run one case alone on worker 0 (for shrinking)."""
        while any(w.case is not None for w in self.workers):
            self.collect()
        self.workers[0].submit(case, timeout_s)
        while True:
            for _, status, detail in self.collect():
                return status, detail

    def close(self) -> None:
        for w in self.workers:
            w.stop()


# --------------------------------------------------------------------------- shrinking
def _candidates(kind: str, spec: str):
    """Smaller versions of ``spec``, biggest cuts first."""
    import re
    if kind == "grammar":
        lines = spec.split("\n")
        for i in range(1, len(lines)):
            yield "\n".join(lines[:i] + lines[i + 1:])
        for i, line in enumerate(lines):
            name, _, body = line.partition(" ::= ")
            alts = body.split(" | ")
            for j in range(len(alts)):
                if len(alts) > 1:
                    yield "\n".join(lines[:i] + [f"{name} ::= " + " | ".join(
                        alts[:j] + alts[j + 1:])] + lines[i + 1:])
            parts = body.split(" ")
            for j in range(len(parts)):
                if len(parts) > 1:
                    yield "\n".join(lines[:i] + [f"{name} ::= " + " ".join(
                        parts[:j] + parts[j + 1:])] + lines[i + 1:])
    elif kind == "json":
        doc = json.loads(spec)
        for smaller in _json_cuts(doc):
            yield json.dumps(smaller, ensure_ascii=False)
    else:
        size = len(spec) // 2
        while size >= 1:
            for start in range(0, len(spec), size):
                yield spec[:start] + spec[start + size:]
            size //= 2
    for match in re.finditer(r"\d{2,}", spec):  # halve large counts
        yield spec[:match.start()] + str(int(match.group()) // 2) + spec[match.end():]


def _json_cuts(doc):
    if isinstance(doc, dict):
        for key in list(doc):
            yield {k: v for k, v in doc.items() if k != key}
        for key, value in doc.items():
            for smaller in _json_cuts(value):
                yield {**doc, key: smaller}
    elif isinstance(doc, list):
        for i in range(len(doc)):
            if len(doc) > 1:
                yield doc[:i] + doc[i + 1:]
        for i, value in enumerate(doc):
            for smaller in _json_cuts(value):
                yield doc[:i] + [smaller] + doc[i + 1:]


def shrink(pool: Pool, case: tuple, status: str, timeout_s: float, budget_s: float) -> tuple:
    """Delete parts of the case while it keeps ending in ``status``; within ``budget_s``."""
    kind, spec, vocab, seed = case
    end = time.monotonic() + budget_s
    improved = True
    while improved and time.monotonic() < end:
        improved = False
        for smaller in _candidates(kind, spec):
            if time.monotonic() >= end:
                break
            if smaller == spec:
                continue
            got, _ = pool.run_one((kind, smaller, vocab, seed), timeout_s)
            if got == status:
                spec, improved = smaller, True
                break
    return kind, spec, vocab, seed


# --------------------------------------------------------------------------- main
def _record(counts: Counter, incidents: list, case: tuple, status: str, detail: str) -> None:
    counts[(case[0], "cases")] += 1
    counts[(case[0], status)] += 1
    if status in ("died", "timeout", "memory", "error", "slow"):
        incidents.append((case, status, detail))
        print(f"{status:8} {case[0]:7} {case[2]:7} {detail} :: {case[1][:300]!r}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--case-timeout", type=float, default=10.0)
    parser.add_argument("--shrink-per-class", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pool = Pool(args.workers)
    start = time.monotonic()
    fuzz_end = start + args.minutes * 60 * 0.75  # the rest for shrinking
    counts: Counter = Counter()
    incidents: list[tuple] = []
    case_no = 0
    while time.monotonic() < fuzz_end:
        for w in pool.workers:
            if w.case is None:
                kind = rng.choice(KINDS)
                vocab = "smollm2" if rng.random() < 0.25 else "small"
                w.submit((kind, GENERATORS[kind](rng), vocab, case_no), args.case_timeout)
                case_no += 1
        for case, status, detail in pool.collect():
            _record(counts, incidents, case, status, detail)
    while any(w.case is not None for w in pool.workers):
        for case, status, detail in pool.collect():
            _record(counts, incidents, case, status, detail)
    reproducers = []
    shrunk: Counter = Counter()
    end = start + args.minutes * 60
    for case, status, detail in incidents:
        cls = (case[0], status, detail.split()[0] if detail else "")
        if status in ("error", "slow") or shrunk[cls] >= args.shrink_per_class:
            continue
        if time.monotonic() >= end:
            print("out of time: the remaining incidents are not shrunk", flush=True)
            break
        if status == "timeout":  # confirm with a longer limit
            status2, _ = pool.run_one(case, args.case_timeout * 6)
            if status2 != "timeout":
                print(f"timeout not confirmed ({status2}): {case[1][:200]!r}", flush=True)
                continue
        shrunk[cls] += 1
        budget = max(30.0, (end - time.monotonic()) / 2)
        small = shrink(pool, case, status, args.case_timeout, budget)
        reproducers.append({"kind": small[0], "vocab": small[2], "status": status,
                            "detail": detail, "spec": small[1], "original": case[1]})
        print(f"REPRO {status} {small[0]} {small[2]} {detail}: {small[1]!r}", flush=True)
    pool.close()
    print(f"\n{case_no} cases in {time.monotonic() - start:.0f} s, seed {args.seed}")
    for kind in KINDS:
        row = {s: counts[(kind, s)] for s in ("cases", "ok", "refused", "error", "slow",
                                              "died", "timeout", "memory")}
        print(f"  {kind:8} " + " ".join(f"{k}={v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"counts": {f"{k}.{s}": v for (k, s), v in counts.items()},
                       "reproducers": reproducers,
                       "incidents": [{"kind": c[0], "vocab": c[2], "status": st, "detail": d,
                                      "spec": c[1]} for c, st, d in incidents]},
                      f, indent=1, ensure_ascii=False)
    return 1 if any(st in ("died", "timeout", "memory") for _, st, _ in incidents) else 0


if __name__ == "__main__":
    sys.exit(main())
