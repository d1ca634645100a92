"""Client-side helpers for the real-tritonserver tests: the stock clients only (tritonclient.grpc,
plain HTTP), Prometheus text parsing."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient


def text_inputs(prompt: str | bytes, stream: bool, sampling: dict | None = None, **flags: bool):
    """vllm_backend-contract inputs: text_input, stream, sampling_parameters, bool flags."""
    data = prompt.encode() if isinstance(prompt, str) else prompt
    tensors = [("text_input", np.array([data], dtype=np.object_), "BYTES"),
               ("stream", np.array([stream]), "BOOL")]
    if sampling is not None:
        tensors.append(("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"))
    for name, value in flags.items():
        tensors.append((name, np.array([value]), "BOOL"))
    out = []
    for name, array, dtype in tensors:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def token_inputs(ids: list[int], max_tokens: int, stream: bool = False, **extra: tuple[np.ndarray, str]):
    arrays = {"input_ids": (np.array(ids, dtype=np.int32), "INT32"),
              "request_output_len": (np.array([max_tokens], dtype=np.int32), "INT32"),
              "streaming": (np.array([stream]), "BOOL"), **extra}
    out = []
    for name, (array, dtype) in arrays.items():
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


@dataclass
class StreamResult:
    responses: list = field(default_factory=list)
    """(InferResult, is_final) in arrival order."""
    error: Exception | None = None
    times: list[float] = field(default_factory=list)

    def texts(self, name: str = "text_output") -> list[str]:
        return ["".join(x.decode() for x in r.as_numpy(name)) for r, _ in self.responses if r.as_numpy(name) is not None]

    @property
    def finals(self) -> list[bool]:
        return [final for _r, final in self.responses]


class GrpcStream:
    """One gRPC bidirectional stream (one client per stream, as tritonclient allows)."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error, time.monotonic())))

    def send(self, model: str, inputs, request_id: str = "", parameters: dict | None = None) -> None:
        # enable_empty_final_response: every response says whether it is the final one, so the test
        # can check that FINAL rides on the last data response.
        self.client.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters,
                                       enable_empty_final_response=True)

    def collect(self, timeout: float = 60.0, stop_after: int | None = None) -> StreamResult:
        """Responses of one request until its final one (or an error, or `stop_after` responses)."""
        res = StreamResult()
        deadline = time.monotonic() + timeout
        while True:
            result, error, at = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if error is not None:
                res.error = error
                return res
            final = result.get_response().parameters["triton_final_response"].bool_param
            res.responses.append((result, final))
            res.times.append(at)
            if final or (stop_after is not None and len(res.responses) >= stop_after):
                return res

    def close(self, cancel: bool = False) -> None:
        if self.client is None:  # closed already
            return
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()
        self.client = None


def grpc_request(url: str, model: str, inputs, timeout: float = 60.0) -> StreamResult:
    s = GrpcStream(url)
    try:
        s.send(model, inputs)
        return s.collect(timeout)
    finally:
        s.close()


def http_post(url: str, body: dict | bytes, timeout: float = 60.0) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)\{([^}]*)\} (\S+)$')


def scrape(metrics_url: str, model: str = "pagedserve") -> dict[str, float]:
    """{name or name{extra labels}: value} for the `model` samples of the pagedserve: families."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith("pagedserve:"):
            continue
        labels = dict(kv.split("=", 1) for kv in m.group(2).split(",") if kv)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.pop("model", None) != model:
            continue
        labels.pop("version", None)
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        out[key] = float(m.group(3))
    return out


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
