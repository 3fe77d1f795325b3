"""``FakeEngine``: the slice of ``LLMEngine`` that ``AsyncEngine`` drives, with every step
computable by hand (each unfinished request gets token ``step number`` until it has
``max_tokens``), for the engine-loop and stream-failure tests."""

from __future__ import annotations

import time

from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import Request, RequestStatus


class FakeEngine:
    """The slice of ``LLMEngine`` that ``AsyncEngine`` drives; ``max_running`` requests
    decode per step, the rest wait (FCFS)."""

    def __init__(self, max_running: int = 2, step_s: float = 0.0, fail_at_step: int = -1):
        self.requests: dict[str, Request] = {}
        self.order: list[str] = []
        self.max_running = max_running
        self.step_s = step_s
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.released: list[str] = []

    def add_request(self, prompt_token_ids, sampling, req_id=None, slo=None,
                    arrival_time=None, cache_salt=None, fork_of=None) -> str:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.requests[req_id] = Request(req_id, list(prompt_token_ids), sampling)
        self.order.append(req_id)
        return req_id

    def _unfinished(self) -> list[Request]:
        return [self.requests[i] for i in self.order
                if i in self.requests and not self.requests[i].status.is_finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished())

    def abort_request(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None or req.status.is_finished:
            return False
        req.set_status(RequestStatus.FINISHED_ABORTED)
        return True

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("device on fire")
        time.sleep(self.step_s)
        outputs = []
        for req in self._unfinished()[: self.max_running]:
            req.output_token_ids.append(self.num_steps)
            req.token_times.append(time.perf_counter())
            done = len(req.output_token_ids) >= req.sampling.max_tokens
            if done:
                req.set_status(RequestStatus.FINISHED_LENGTH)
            outputs.append(RequestOutput(req.req_id, [self.num_steps], f"<{self.num_steps}>",
                                         done, req.status.finish_reason, req))
        return outputs

    def release(self, req_id: str) -> Request | None:
        self.released.append(req_id)
        return self.requests.pop(req_id, None)

    def stats(self) -> dict[str, int]:
        running = self._unfinished()[: self.max_running]
        return {"num_running": len(running),
                "num_waiting": len(self._unfinished()) - len(running),
                "device_pages_total": 10, "device_pages_free": 10 - len(running)}
