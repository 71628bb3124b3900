"""Downstream evaluation (issue 25 item 5b, 5c): multiple-choice tasks in HellaSwag's layout scored by
nanomega.eval.evaluate, and the lm-evaluation-harness adapter running a local task through lm_eval.simple_evaluate.

The reference is independent of both: the checkpoint exported to a Hugging Face folder (nanomega.hf.transfer) and run
by transformers in float64, one (context, ending) at a time, each ending's log-likelihood summed over its own
tokens after lm-eval's rules (a space before the ending, at most max_seq_len + 1 tokens kept from the right),
acc and acc_norm (divided by the ending's length in characters, as lm-eval's multiple_choice does) taken by
numpy's argmax. Offline: the task is a JSONL file written here and read by lm-eval's `json` dataset.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train as train_script
from nanomega import checkpoint
from nanomega.hf import transfer as hf
from nanomega.config import Config, ModelConfig, parse_args, to_dict
from nanomega.eval.evaluate import load_run, multiple_choice, read_task
from nanomega.eval.generate import sample
from nanomega.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
# A llama-shaped byte model (the tokenizer every run so far uses) of 32 positions: the contexts below are
# longer, so left truncation is exercised. init_std 0.5 spreads the logits, so no two endings nearly tie.
MODEL = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                    init_std=0.5)
DOCS = [
    {"query": "A man is sitting on a roof. He", "choices": ["starts pulling up roofing.", "is ripping level tiles off.",
                                                             "is holding a rubik's cube.", "eats"], "gold": 0},
    {"query": "Baking: the oven is hot", "choices": ["so she puts the tray in.", "and the cat sleeps.",
                                                      "café au lait, s'il vous plaît", "!"], "gold": 2},
    {"query": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None", "print(a, b) and then more"],
     "gold": 0},
    {"query": "The quick brown fox jumps over the lazy dog while the farmer watches from far", "choices":
        ["away.", "behind a tree and laughs", "ñandú", "x"], "gold": 1},
    {"query": "Q: 2 + 2 =", "choices": ["4", "5", "22", "four"], "gold": 0},
    {"query": "Shopping: she walks into the store and", "choices": ["buys milk.", "flies.", "sings a song loudly",
                                                                     "reads"], "gold": 3},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from nanomega.models import init
    path = tmp_path_factory.mktemp("run")
    checkpoint.save(path, 5, init(MODEL, seed=1), {}, {"config": to_dict(Config(model=MODEL))}, keep=1)
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("task") / "toy_mc.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


@pytest.fixture(scope="module")
def reference(run, tmp_path_factory) -> dict:
    """acc, acc_norm and every ending's log-likelihood by transformers in float64 (module docstring)."""
    transformers = pytest.importorskip("transformers")
    folder = hf.export(run, tmp_path_factory.mktemp("hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    lls, acc, acc_norm = [], 0, 0
    for doc in DOCS:
        row = []
        for ending in doc["choices"]:
            context, continuation = list(doc["query"].encode()), list((" " + ending).encode())
            ids = torch.tensor([(context + continuation)[-(MODEL.max_seq_len + 1):]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0], -1)
            n = len(continuation)
            row.append(logp[-n:].gather(1, ids[0, -n:, None]).sum().item())
        lls.append(row)
        acc += int(np.argmax(row)) == doc["gold"]
        acc_norm += int(np.argmax(np.array(row) / [len(c) for c in doc["choices"]])) == doc["gold"]
    return {"acc": acc / len(DOCS), "acc_norm": acc_norm / len(DOCS), "lls": lls}


def test_read_task_accepts_lm_evals_and_hellaswags_fields_and_names_a_bad_record(tmp_path):
    raw = {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
           "ctx": "A man is sitting on a roof. he", "endings": ["is using wrap to wrap a pair of skis.",
                                                                "starts pulling up roofing [title] on a roof."],
           "label": "1"}
    plain = {"ctx": "Hello", "endings": ["world", "there"], "label": 0}
    (tmp_path / "t.jsonl").write_text(f"{json.dumps(DOCS[0])}\n\n{json.dumps(raw)}\n{json.dumps(plain)}\n")
    a, b, c = read_task(tmp_path / "t.jsonl")
    assert (a.context, a.endings, a.label) == (DOCS[0]["query"], DOCS[0]["choices"], 0)
    # lm-eval's hellaswag prompt: "<activity>: <ctx_a> <ctx_b capitalized>", " [title]" -> ". "
    assert b.context == "Roof shingle removal: A man is sitting on a roof. He" and b.label == 1
    assert b.endings[1] == "starts pulling up roofing. on a roof."
    assert (c.context, c.endings, c.label) == ("Hello", ["world", "there"], 0)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*query/choices/gold.*ctx/endings/label"):
        read_task(tmp_path / "bad.jsonl")
    (tmp_path / "label.jsonl").write_text(json.dumps({"ctx": "x", "endings": ["a", "b"], "label": 2}) + "\n")
    with pytest.raises(ValueError, match="label 2 is not an index"):
        read_task(tmp_path / "label.jsonl")


def test_multiple_choice_equals_transformers_float64(run, task, reference):
    params, cfg, tok, _ = load_run(run, torch.device("cpu"))
    ours = multiple_choice(params, cfg.model, tok, read_task(task), torch.device("cpu"), batch_size=5)
    assert (ours["acc"], ours["acc_norm"]) == (reference["acc"], reference["acc_norm"])
    assert 0 < reference["acc"] < 1 and reference["acc"] != reference["acc_norm"]   # the two rules differ here


def test_lm_eval_through_the_adapter_equals_transformers_float64(run, task, reference, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    import nanomega.eval.lm_eval_adapter  # noqa: F401  (registers the "nanomega" model)
    ref = reference
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "toy_mc.yaml").write_text(
        f"task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task}\n"
        f"  cache_dir: {tmp_path / 'datasets'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{query}}'\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)   # not lm-eval's own 14 s index
    out = lm_eval.simple_evaluate(model="nanomega", model_args={"run": str(run)}, tasks=["toy_mc"], batch_size=3,
                                  device="cpu", task_manager=tasks, log_samples=True)
    theirs = out["results"]["toy_mc"]
    assert (theirs["acc,none"], theirs["acc_norm,none"]) == (ref["acc"], ref["acc_norm"])
    samples = sorted(out["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    got = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    np.testing.assert_allclose(got, ref["lls"], rtol=1e-5)


def test_generate_until_is_greedy_sampling_cut_at_the_stop_string(run):
    pytest.importorskip("lm_eval")
    from nanomega.eval.lm_eval_adapter import NanomegaLM
    lm = NanomegaLM(run=str(run), device="cpu")
    context = "def add(a, b):\n    return a"
    # as lm-eval's HFLM, the context keeps its last max_seq_len - max_gen_toks tokens: 20 of these 27
    ids = torch.tensor([list(context.encode())[-(MODEL.max_seq_len - 12):]])
    greedy = sample(lm.params, MODEL, ids, 12, temperature=0)[0, ids.shape[1]:].tolist()
    text = lm.tok_decode(greedy)
    short = torch.tensor([list(context.encode())])      # 3 new tokens: the whole context fits
    first3 = sample(lm.params, MODEL, short, 3, temperature=0)[0, short.shape[1]:].tolist()
    assert 0 not in greedy + first3           # no EOS (NUL) in this one: it would end generation early
    stop = text[5:7]
    expected = text[:text.index(stop)]
    requests = [SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 12})),
                SimpleNamespace(args=(context, {"until": ["\x01\x02never"], "max_gen_toks": 12})),
                SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 3}))]
    assert lm.generate_until(requests) == [expected, text, lm.tok_decode(first3)]
    with pytest.raises(ValueError, match="greedily only"):
        lm.generate_until([SimpleNamespace(args=(context, {"do_sample": True, "temperature": 0.7}))])


def test_loglikelihood_rolling_of_a_long_text_equals_its_windows_in_float64(run):
    """lm-eval's rolling windows with context 1 over 70 bytes and 32 positions: [EOS] + bytes 0-30 predict
    bytes 0-31, bytes 31-62 predict 32-63, and the last window (full context) predicts 64-69."""
    pytest.importorskip("lm_eval")
    from nanomega.eval.lm_eval_adapter import NanomegaLM
    from nanomega.models import forward
    from nanomega.tree import tree_map
    lm = NanomegaLM(run=str(run), device="cpu")
    text = "The quick brown fox jumps over the lazy dog; the lazy dog sleeps on..."
    b = list(text.encode())
    assert len(b) == 70
    params64 = tree_map(lambda t: t.double(), lm.params)
    expected = 0.0
    for inputs, first_target in (([0] + b[:31], 0), (b[31:63], 32), (b[37:69], 64)):
        logp = torch.log_softmax(forward(params64, torch.tensor([inputs]), MODEL)[0, :, :256], -1)
        targets = b[first_target:first_target + (32 if first_target < 64 else 6)]
        expected += logp[-len(targets):].gather(1, torch.tensor(targets)[:, None]).sum().item()
    (got,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("train:300", marks=pytest.mark.slow)])
def test_train_logs_task_accuracy_every_eval_and_refuses_a_bad_task_before_work(task, tmp_path, corpus, tokenizer):
    """The numbers logged during training equal python -m nanomega.eval's on the checkpoint, with the run's
    own tokenizer in both (a BPE trained on the corpus: its ids mean nothing as bytes)."""
    args = [f"--data.tokenizer={tokenizer}", "--model.d_model=32", "--model.n_layers=1", "--model.n_heads=4",
            "--model.ffn_dim=64", "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=4", "--train.compile=false",
            "--train.eval_batches=1", "--train.sample_tokens=0", "--train.steps=4", "--train.eval_every=2",
            f"--data.path={corpus}", f"--data.cache_dir={tmp_path}", f"--train.out_dir={tmp_path / 'out'}",
            f"--eval.tasks={task}"]
    train_script.train(parse_args(args), quiet=True)
    records = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "eval/toy_mc/acc" in r]
    assert [r["step"] for r in records] == [2, 4]
    params, cfg, tok, _ = load_run(tmp_path / "out", torch.device("cpu"))
    assert tok.vocab_size == (256 if tokenizer == "bytes" else 300)
    again = multiple_choice(params, cfg.model, tok, read_task(task), torch.device("cpu"))
    assert (records[-1]["eval/toy_mc/acc"], records[-1]["eval/toy_mc/acc_norm"]) == (again["acc"], again["acc_norm"])

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": [], "label": 0}\n')
    done = subprocess.run([sys.executable, "train.py", *args[:-2], f"--train.out_dir={tmp_path / 'out2'}",
                           f"--eval.tasks={bad}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "bad.jsonl:1: the context must be a string and the endings a list" in done.stderr
    assert not (tmp_path / "out2").exists()


def test_the_command_line_prints_a_table(run, task):
    done = subprocess.run([sys.executable, "-m", "nanomega.eval", "--run", str(run), "--tasks", str(task)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    params, cfg, tok, _ = load_run(run, torch.device("cpu"))
    ours = multiple_choice(params, cfg.model, tok, read_task(task), torch.device("cpu"))
    assert ["toy_mc", str(len(DOCS)), f"{ours['acc']:.4f}", f"{ours['acc_norm']:.4f}"] in \
        [line.split() for line in done.stdout.splitlines()]


def test_preflight_refuses_tasks_on_a_mesh_and_two_tasks_of_one_name(task, tmp_path):
    from nanomega.run.preflight import check_tasks
    check_tasks([str(task)], world_size=1)
    with pytest.raises(ValueError, match="python -m nanomega.eval --run <out_dir>"):
        check_tasks([str(task)], world_size=2)
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / task.name
    twin.write_text(task.read_text())
    with pytest.raises(ValueError, match="two files share a name"):
        check_tasks([str(task), str(twin)], world_size=1)


def test_encode_pair_splits_as_lm_evals_template_lm_with_a_bpe(run):
    """With a BPE, where the split falls and where spaces go matter: our encode_pair against lm-eval's own
    TemplateLM.loglikelihood tokenization, run on the adapter with that tokenizer (contexts with and without
    trailing spaces, and an empty one)."""
    pytest.importorskip("lm_eval")
    from nanomega.eval.evaluate import encode_pair
    from nanomega.eval.lm_eval_adapter import NanomegaLM
    from nanomega.data.tokenizer import train_bpe
    text = " ".join(d["query"] + " " + " ".join(d["choices"]) for d in DOCS) * 20
    bpe = train_bpe([text], 300)
    lm = NanomegaLM(run=str(run), device="cpu")
    lm.tokenizer = bpe
    seen = []
    lm._loglikelihood_tokens = lambda requests, **kw: seen.extend((c, n) for _, c, n in requests) or []
    pairs = [(d["query"] + tail, " " + e) for d in DOCS for e in d["choices"] for tail in ("", "  ")] + [("", "roof")]
    lm.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    assert [encode_pair(bpe, c, e) for c, e in pairs] == seen
    # the context's trailing spaces moved into the continuation: its ids are not the ending's own
    assert sum(n != bpe.encode(e) for (_, e), (_, n) in zip(pairs, seen)) == len(pairs) // 2
