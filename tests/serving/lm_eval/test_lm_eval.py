"""EleutherAI's lm-eval (lm-evaluation-harness) scoring a multiple-choice task through the
server, beside lm-eval's own ``hf`` model on the same weights.

The task (``facts_mc.yaml`` over ``data/facts_mc.jsonl``, both written for these tests) is
18 zero-shot factual questions with 3-4 answers each; lm-eval scores every answer by the
loglikelihood of `` <answer>`` after the question and picks the highest. Two runs:

* ``local-completions`` pointed at a real ``superinfer serve`` process with the embedded
  SmolLM2-135M (a random tiny model sits at chance and proves little). lm-eval sends the
  token ids of question + answer (several prompts per request), ``echo: true``,
  ``logprobs: 1``, ``max_tokens: 1``, and sums the echoed prompt's ``token_logprobs`` over
  the answer's tokens; ``top_logprobs`` says whether each answer token was the argmax.
* lm-eval's ``hf`` model (``HFLM``) around transformers' Llama holding the same GGUF Q4_1
  weights dequantized to float32 (``models.hf_export.to_transformers``), the reference the
  model tests already use.

Both tokenize with one Hugging Face tokenizer directory written from the served model's
tokenizer. Every item must pick the same answer on both sides, every (item, answer)
loglikelihood must agree within 1e-3 and so must lm-eval's ``is_greedy``. Nothing is
downloaded: the hub and datasets are offline, the data file is local, and the datasets
cache is a temporary directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.serving.serving_testlib import API_KEY, ServerProcess, write_hf_tokenizer_dir

lm_eval = pytest.importorskip("lm_eval")

HERE = Path(__file__).resolve().parent
TASK = "superinfer_facts_mc"
MODEL = "smollm2-135m"  # the embedded preset; also the name the server serves it under

# Loglikelihoods are sums of float32 log-softmax values, computed by XLA:CPU (paged
# attention, the server's bucketed step) on one side and by torch on the other, over the
# same float32 weights (GGUF Q4_1 dequantized once): quantization is not a difference
# here, only the summation order of float32 arithmetic. Each logit goes through 30 layers
# (reductions of up to 1536 terms, logits of magnitude ~10-30), and two summation orders
# differ by about eps * sqrt(n * depth) * |logit| ~ 1.2e-7 * 218 * 20 ~ 5e-4 in the worst
# case, typically far less since most of that error is common to every logit of a row and
# log-softmax (logit minus the log-sum-exp over the 49k vocabulary) cancels it. An answer
# here is 1-5 tokens. Measured, our engine's logits against lm-eval's hf run on this task
# differ by at most 5e-5 in an answer's loglikelihood, while the closest two answers of an
# item are 3.5e-2 apart: 1e-3 is 20x the float32 noise and 35x smaller than the margin
# that decides any item, so a wrong position, token or normalisation cannot pass.
LL_TOL = 1e-3


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory):
    """No hub, no dataset download, for this module (restored afterwards)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("OPENAI_API_KEY", API_KEY)  # what local-completions sends as its Bearer key
        yield


@pytest.fixture(scope="module")
def smollm2_server(xla_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server process of SmolLM2, started here and waited for by the test (so that it
    loads and compiles while the hf run computes). Warm-up is off: the test compiles only
    the step shapes it uses (persistent XLA cache), not every bucket."""
    log = tmp_path_factory.mktemp("lm-eval-server") / "server.log"
    srv = ServerProcess(Path(MODEL), xla_cache, log, "--api-key", API_KEY,
                        "--max-num-seqs", "4", "--no-warmup")
    yield srv
    try:
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer directory of SmolLM2's tokenizer (both lm-eval runs read it,
    so both send the same token ids), loadable with no network."""
    from transformers import AutoTokenizer

    tok = smollm2.tokenizer
    path = write_hf_tokenizer_dir(tok, tmp_path_factory.mktemp("lm-eval-tokenizer"))
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text = "Question: What is the capital of France?\nAnswer: Paris"
    # hf adds no BOS by default, as lm-eval's API model (add_bos_token=False) does not.
    assert hf(text).input_ids == hf(text, add_special_tokens=False).input_ids \
        == tok.encode(text)
    return path


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory: pytest.TempPathFactory):
    """The shipped task YAML with its data file made absolute (lm-eval hands
    ``data_files`` to ``datasets`` as is, relative to the working directory) and the
    datasets cache in a temporary directory; only this task is indexed."""
    from lm_eval.tasks import TaskManager

    cfg = yaml.safe_load((HERE / "facts_mc.yaml").read_text())
    cfg["dataset_kwargs"]["data_files"]["test"] = str(HERE / "data" / "facts_mc.jsonl")
    root = tmp_path_factory.mktemp("lm-eval-task")
    cfg["dataset_kwargs"]["cache_dir"] = str(root / "datasets-cache")
    (root / "tasks").mkdir()
    (root / "tasks" / "facts_mc.yaml").write_text(yaml.safe_dump(cfg))
    return TaskManager(include_path=str(root / "tasks"), include_defaults=False)


def _evaluate(model, task_manager, **kw) -> tuple[dict, float, float]:
    """One lm-eval run: ({doc_id: [(loglikelihood, is_greedy) per answer]}, acc, seconds)."""
    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(model=model, tasks=[TASK], task_manager=task_manager,
                                  num_fewshot=0, log_samples=True, bootstrap_iters=0,
                                  **kw)
    elapsed = time.monotonic() - t0
    per_doc = {s["doc_id"]: [(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]]
               for s in out["samples"][TASK]}
    return per_doc, out["results"][TASK]["acc,none"], elapsed


def test_lm_eval_loglikelihoods_match_hf(offline, smollm2_server, smollm2, tokenizer_dir,
                                         task_manager):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from models.hf_export import to_transformers

    hf_lm = HFLM(pretrained=to_transformers(smollm2, dtype="float32"),
                 tokenizer=AutoTokenizer.from_pretrained(str(tokenizer_dir)),
                 batch_size=8, device="cpu")
    ref, ref_acc, ref_s = _evaluate(hf_lm, task_manager)

    smollm2_server.wait_serving(timeout_s=300)
    served, acc, served_s = _evaluate(
        "local-completions", task_manager, batch_size=4,
        model_args={
            "model": MODEL,
            "base_url": f"{smollm2_server.http_url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer_dir),
            "tokenized_requests": True,
            "max_length": 256,  # the server's --max-model-len
            "num_concurrent": 1,
            "max_retries": 1,
            "timeout": 120,
        })
    assert smollm2_server.proc.poll() is None, smollm2_server.log()

    n_items = sum(1 for _ in (HERE / "data" / "facts_mc.jsonl").open())
    assert sorted(ref) == sorted(served) == list(range(n_items))
    diffs, mismatched = [], []
    for doc_id, ref_choices in ref.items():
        ours = served[doc_id]
        assert len(ours) == len(ref_choices), doc_id
        ref_ll = [ll for ll, _ in ref_choices]
        our_ll = [ll for ll, _ in ours]
        if max(range(len(ours)), key=our_ll.__getitem__) != max(
                range(len(ours)), key=ref_ll.__getitem__):
            mismatched.append(doc_id)
        diffs += [abs(a - b) for a, b in zip(our_ll, ref_ll, strict=True)]
        assert [g for _, g in ours] == [g for _, g in ref_choices], (doc_id, ours, ref_choices)
    greedy = sum(g for choices in ref.values() for _, g in choices)
    summary = (f"{n_items} items, {len(diffs)} answers ({greedy} greedy): max |ll_server - "
               f"ll_hf| {max(diffs):.2e}; acc server {acc:.3f}, hf {ref_acc:.3f}; "
               f"lm-eval hf run {ref_s:.1f} s, server run {served_s:.1f} s")
    print(summary)
    assert not mismatched, f"items choosing another answer: {mismatched}; {summary}"
    assert max(diffs) <= LL_TOL, summary
    assert acc == ref_acc, summary
