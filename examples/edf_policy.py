"""Earliest deadline first (docs/research.md): a request's deadline is its TTFT deadline
until its first token, then its next token's; contended, the earliest deadlines keep the
device (a runner first settles for ``min_residency_tokens``), the rest rotate to the host.

    superinfer simulate --preset paper-qwen32b-sharegpt --hardware gh200-96g --rates 20 \\
        --duration-s 60 --policies fcfs,rotasched,examples.edf_policy:EDFPolicy
    python -m examples.edf_policy          # the real engine, a tiny random model
"""
import bisect

from superinfer_jax.request import Request, RequestStatus
from superinfer_jax.sched.rotasched import HOST, Policy, register_policy


@register_policy("edf")
class EDFPolicy(Policy):
    def contended(self, s) -> bool:  # past the high-water mark, or someone is parked
        used, usable = s.device_pages_in_use()
        return bool(s.rotary) or used >= self.config.rotasched.high_water_mark * usable

    def rank(self, s, now: float) -> list[Request]:  # settling runners, then deadlines
        k = self.config.rotasched.min_residency_tokens
        return sorted(s.candidates(), key=lambda r: (not settling(r, k), deadline(r)))

    def evict_to(self, s, req: Request) -> str:
        return HOST


def deadline(r: Request) -> float:
    return r.token_times[-1] + r.slo.tbt_s if r.token_times else r.arrival_time + r.slo.ttft_s


def settling(r: Request, k: int) -> bool:  # running, < k tokens since it last started
    return (r.status == RequestStatus.RUNNING and r.running_since is not None
            and len(r.token_times) - bisect.bisect_left(r.token_times, r.running_since) < k)


def main() -> None:
    from models.config import ModelConfig
    from models.servable import random_servable
    from superinfer_jax import SLO, EngineConfig, LLMEngine, SamplingParams

    model = random_servable(ModelConfig("tiny", 256, 64, 128, 2, 4, 2, 16), seed=1)
    engine = LLMEngine(model, EngineConfig.build(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
        max_prefill_rows=1, page_size=8, num_device_pages=12, num_host_pages=128,
        policy="examples.edf_policy:EDFPolicy", show_progress=False))
    ids = [engine.add_request(list(range(1, 8 + 3 * i)), slo=SLO(200 + 100 * i, 50),
                              sampling=SamplingParams(max_tokens=24, ignore_eos=True))
           for i in range(6)]
    while engine.has_unfinished_requests():
        engine.step()
    for r in map(engine.release, ids):
        print(f"{r.req_id}: TTFT {1000 * r.ttft:.0f} ms (SLO {r.slo.ttft_ms:.0f}), "
              f"{r.num_rotations} rotations, {len(r.output_token_ids)} tokens, {r.status.name}")


if __name__ == "__main__":
    main()
