"""`pagedserve run-batch`: an OpenAI Batch input file run offline, in-process, on one engine.

    pagedserve run-batch -i requests.jsonl -o results.jsonl [engine flags] [--scheduling-policy P]

Input: one JSON object per line, `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}` (OpenAI's Batch API format). Each body is validated and
answered exactly as the KServe adapter's OpenAI routes do (same protocol models, same response
bodies), so a job gives what the server would have given.

Output: one line per input line, in completion order (match them by custom_id):
  {"id", "custom_id", "response": {"status_code": 200, "request_id", "body": {...}}, "error": null}
A body the routes would refuse gets its 4xx/5xx and OpenAI's error body in `response`; a line that
is not a batch request at all (bad JSON, missing custom_id, unknown url) gets `"response": null` and
`"error": {"code", "message"}` naming the line. A bad line never stops the job.

Resumable: results are appended and flushed as requests finish; on rerun, input lines whose
custom_id (or, for lines without one, line number) is already in the output are skipped, and a
torn last line from a killed run is cut off first. The job runs with the `throughput` scheduling
policy unless the engine config or a flag says otherwise.

A tool, not an adapter: it drives an LLMEngine itself and serves no HTTP. It reuses the KServe
adapter's OpenAI protocol (pydantic), so it needs the `kserve` extra.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.adapters.kserve.errors import error_body, model_not_found, to_openai_error
from pagedserve.adapters.kserve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.adapters.kserve.responses import CompletionRenderer, ResponseRenderer
from pagedserve.adapters.kserve.tool_calls import add_tool_call_parser_arg
from pagedserve.adapters.kserve.tool_responses import chat_renderer
from pagedserve.core.validation import parse_json_object
from pagedserve.tools.engine_args import add_engine_args, engine_config_from_args

URLS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
BATCH_DEFAULTS = {"scheduling_policy": "throughput", "scheduling_age_bound_s": 86400.0}
"""What an offline job runs with unless the engine config or flags say otherwise: throughput
ordering, and an age bound longer than any job (no request is online, nobody waits on one)."""


class BadLine(ValueError):
    """A line that is not a batch request; the message says what is wrong and how to fix it."""

    def __init__(self, message: str, line: "BatchLine | None" = None) -> None:
        super().__init__(message)
        self.line = line


@dataclass
class BatchLine:
    line_no: int
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """What resume matches on: the custom_id, or the line number for a line without one."""
        return self.custom_id if self.custom_id is not None else f"line {self.line_no}"


@dataclass
class Job:
    """One input line in flight: its engine requests and the renderer assembling its body."""

    line: BatchLine
    renderer: ResponseRenderer
    prompt_index: dict[str, int]
    remaining: int
    """Final outputs still to come (prompts x n samples)."""


def parse_line(line_no: int, raw: str) -> BatchLine:
    obj = parse_json_object(raw, BadLine, f"line {line_no}", "each line must be one JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(f"line {line_no}: custom_id must be a non-empty string (got {custom_id!r})")
    line = BatchLine(line_no, custom_id)
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise _bad(line, f"unknown key(s) {unknown}; a batch line has custom_id, method, url and body")
    if obj.get("method", "POST") != "POST":
        raise _bad(line, f"method={obj.get('method')!r}; only POST is supported")
    if obj.get("url") not in URLS:
        raise _bad(line, f"url={obj.get('url')!r}; use one of {sorted(URLS)}")
    if not isinstance(obj.get("body"), dict):
        raise _bad(line, "body must be a JSON object (the request body of the url)")
    line.url, line.body = obj["url"], obj["body"]
    return line


def _bad(line: BatchLine, message: str) -> BadLine:
    return BadLine(f"line {line.line_no} (custom_id {line.custom_id!r}): {message}", line)


def completed_keys(output: Path) -> set[str]:
    """Keys of lines already answered in `output`; cuts off a torn last line first."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with output.open("r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    keys = set()
    for i, raw in enumerate(data.decode("utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        rec = parse_json_object(raw, BadLine, f"{output} line {i} (a result record)", "pass a fresh -o or fix that file")
        keys.add(rec["custom_id"] if rec.get("custom_id") is not None else rec["id"].removeprefix("batch_req_"))
    return keys


def record(line: BatchLine, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{line.key}", "custom_id": line.custom_id, "response": response, "error": error}


def error_response(line: BatchLine, exc: BaseException, request_id: str | None = None) -> dict[str, Any]:
    err = to_openai_error(exc)
    return record(line, {"status_code": err.status, "request_id": request_id, "body": error_body(err)}, None)


class BatchRunner:
    def __init__(self, engine: Any, served_model_name: str | None, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.tool_call_parser = tool_call_parser
        """How tool_choice "auto" finds calls (--tool-call-parser); None: "auto" is refused."""
        self.jobs: dict[str, Job] = {}
        """engine request id -> its job."""
        self.output_tokens = 0

    def start(self, line: BatchLine) -> dict[str, Any] | None:
        """Queue a line's engine requests; returns its result record at once if it fails."""
        try:
            req = parse_request(URLS[line.url], json.dumps(line.body).encode())
            if self.served_model_name is not None and req.model != self.served_model_name:
                raise model_not_found(req.model, self.served_model_name)
            decode = self.engine.tokenizer.decode
            rid = f"line{line.line_no}"
            if isinstance(req, ChatCompletionRequest):
                tools = req.tool_plan(self.tool_call_parser)
                params, engine_kwargs = req.sampling_params(tools), req.engine_kwargs()
                prompts = [self.engine.apply_chat_template(req.template_messages(), tools=tools.template_tools,
                                                           add_generation_prompt=req.add_generation_prompt
                                                           is not False)]
                renderer = chat_renderer(f"chatcmpl-{rid}", req.model, decode, params.n, params.logprobs is not None,
                                         tools, want_prompt_logprobs=req.prompt_logprobs is not None)
            else:
                params, engine_kwargs = req.sampling_params(), req.engine_kwargs()
                prompts = req.prompts()
                renderer = CompletionRenderer(f"cmpl-{rid}", req.model, decode, params.n, params.logprobs is not None,
                                              bool(req.echo), prompts, req.echo_only,
                                              want_prompt_logprobs=req.prompt_logprobs is not None)
        except Exception as exc:  # noqa: BLE001 - a bad body is this line's answer, never the job's end
            return error_response(line, exc)
        job = Job(line, renderer, {}, len(prompts) * params.n)
        added = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{rid}-{i}"
                self.engine.add_request(request_id, prompt, params, **engine_kwargs)
                added.append(request_id)
                job.prompt_index[request_id] = i
        except Exception as exc:  # noqa: BLE001 - e.g. a prompt longer than the model allows
            for request_id in added:
                self.engine.abort_request(request_id)
            return error_response(line, exc, renderer.request_id)
        for request_id in added:
            self.jobs[request_id] = job
        return None

    def step(self) -> list[dict[str, Any]]:
        """One engine step; returns the records of lines that finished in it."""
        done = []
        for out in self.engine.step():
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            job.renderer.add(job.prompt_index[out.request_id], out)
            if out.finished:
                self.output_tokens += out.num_output_tokens
                job.remaining -= 1
                if not job.remaining:
                    for request_id in job.prompt_index:
                        del self.jobs[request_id]
                    done.append(record(job.line, {"status_code": 200, "request_id": job.renderer.request_id,
                                                  "body": job.renderer.body()}, None))
        return done


def read_lines(path: Path) -> list[tuple[int, str]]:
    with path.open(encoding="utf-8") as f:
        return [(i, raw) for i, raw in enumerate(f, 1) if raw.strip()]


def run_batch(engine: Any, input_path: Path, output_path: Path, served_model_name: str | None = None,
              progress: bool = True, max_queued: int = 4096, tool_call_parser: str | None = None) -> dict[str, int]:
    """Run every input line not yet answered in output_path; returns counts."""
    done_keys = completed_keys(output_path)
    runner = BatchRunner(engine, served_model_name, tool_call_parser)
    counts = {"lines": 0, "skipped": 0, "succeeded": 0, "failed": 0}
    bar = None
    with output_path.open("a", encoding="utf-8") as out:
        def write(rec: dict[str, Any]) -> None:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            out.flush()
            ok = rec["response"] is not None and rec["response"]["status_code"] == 200
            counts["succeeded" if ok else "failed"] += 1
            if bar is not None:
                bar.update(1)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{runner.output_tokens / elapsed:.1f} tok/s, {counts['failed']} failed")

        lines = read_lines(input_path)
        counts["lines"] = len(lines)
        todo = []
        for line_no, raw in lines:
            try:
                line = parse_line(line_no, raw)
            except BadLine as exc:
                line = exc.line or BatchLine(line_no, None)
                todo.append((line, exc))
                continue
            todo.append((line, None))
        seen: set[str] = set()
        pending = []
        for line, exc in todo:
            if line.key in done_keys:
                counts["skipped"] += 1
                continue
            if exc is None and line.key in seen:
                exc = _bad(line, "duplicate custom_id; every line needs its own")
            seen.add(line.key)
            pending.append((line, exc))
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(pending), desc="run-batch", unit="req", file=sys.stderr)
        start = time.perf_counter()
        queue = iter(pending)
        exhausted = False
        while True:
            # Keep up to max_queued engine requests queued: enough for the policy to group and
            # order globally, bounded so a huge file is neither tokenized up front nor re-sorted
            # in full every step.
            while not exhausted and len(runner.jobs) < max_queued:
                item = next(queue, None)
                if item is None:
                    exhausted = True
                    break
                line, exc = item
                failed = (record(line, None, {"code": "invalid_batch_line", "message": str(exc)})
                          if exc is not None else runner.start(line))
                if failed is not None:
                    write(failed)
            if not engine.has_unfinished_requests():
                if exhausted:
                    break
                continue
            for rec in runner.step():
                write(rec)
        if bar is not None:
            bar.close()
    counts["output_tokens"] = runner.output_tokens
    counts["seconds"] = round(time.perf_counter() - start, 3)
    return counts


def batch_engine_config(args: argparse.Namespace):
    """--engine-config and the engine flags, read and checked once as every command reads them, with
    BATCH_DEFAULTS for the keys neither sets; --scheduling-policy wins over all."""
    config = engine_config_from_args(args, defaults=BATCH_DEFAULTS)
    if args.scheduling_policy is not None:
        config = config.replace(scheduling_policy=args.scheduling_policy)
    return config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve run-batch", description=__doc__.split("\n\n")[0])
    p.add_argument("-i", "--input", required=True, help="OpenAI Batch input file (JSONL)")
    p.add_argument("-o", "--output", required=True, help="results file (JSONL; appended to, resumable)")
    add_engine_args(p)
    p.add_argument("--scheduling-policy", choices=("fcfs", "prefix", "throughput"), default=None,
                   help="default: throughput (unless --engine-config sets one)")
    p.add_argument("--served-model-name", default=None,
                   help="answer only lines whose body.model is this name (default: run every line on the "
                        "loaded model, whatever body.model says)")
    p.add_argument("--max-queued", type=int, default=4096,
                   help="engine requests queued at once (the scheduling policy orders within them)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_tool_call_parser_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.errors import PagedServeError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    input_path, output_path = Path(args.input), Path(args.output)
    if not input_path.is_file():
        print(f"pagedserve run-batch: error: input file {input_path} not found", file=sys.stderr)
        return 2
    if args.max_queued < 1:
        print("pagedserve run-batch: error: --max-queued must be at least 1", file=sys.stderr)
        return 2
    if input_path.resolve() == output_path.resolve():
        print("pagedserve run-batch: error: -o must differ from -i", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(batch_engine_config(args))
        counts = run_batch(engine, input_path, output_path, args.served_model_name, not args.no_progress,
                           args.max_queued, args.tool_call_parser)
    except (PagedServeError, BadLine) as exc:
        print(f"pagedserve run-batch: error: {exc}", file=sys.stderr)
        return 2
    rate = counts["output_tokens"] / counts["seconds"] if counts["seconds"] else 0.0
    print(f"{counts['lines']} lines: {counts['succeeded']} succeeded, {counts['failed']} failed, "
          f"{counts['skipped']} already in {output_path}; {counts['output_tokens']} output tokens in "
          f"{counts['seconds']:.1f}s ({rate:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
