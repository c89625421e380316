"""Build the small models of the composed demo pipelines (issue #45) from the demo task.

    python scripts/make_compose_task.py OUT_DIR [--seed 0] [--only judge|reviewer|student] [--demo data/demo]

Every model shares the demo's byte-level vocabulary, reads raw text (no chat template) and is saved
(safetensors plus tokenizer) to OUT_DIR/<name> with a summary OUT_DIR/<name>.json:

- judge: "{response} R: {ground_truth} V:" -> " 1" when gsm8k_score(response, ground_truth) is 1,
  else " 0". Trained on a label-balanced mix of responses like a weak policy writes (wrong ones mostly
  near misses) plus the demo model's own samples on train questions, with the loss also on the reference
  (see reference_loss), for 600 steps with the learning rate decaying from 1e-3 to 0 (or until the verdict
  is right on 97% of held-out questions' balanced and demo-sampled answers). Its weights start at std 0.06,
  not transformers' 0.02: from 0.02 attention starts near uniform and the verdict sat at chance for ~1000
  steps before it learned to compare the digits; from 0.06 it rises from step ~200-300. (At lr 1.5e-3 one
  seed in four still trailed, 87% / 81% after 800 steps.)
- reviewer: "{prompt}{response} F:" -> " #### {answer}". It starts out trusting the solver: warm-started to
  give the solver's answer where the solver wrote one (the sum where it did not), until it does so for
  95% of held-out answers sampled from the demo model. Its final answers are then right as often as
  the solver's, so the solver's own answers earn its rewards from the start, and reinforcement
  learning teaches both (the reviewer to correct what it can).
- student: the demo's shape from another random init, warm-started on the demo task only to 5% (the
  teacher, the demo's model, reaches 28%), for on-policy distillation from the demo model. (A smaller
  model, hidden 64, distilled too slowly to show here: the reverse KL fell 0.53 -> 0.49 in 40 steps.)

Each part is skipped when its output exists; the demo task is made with make_demo_task.py when missing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, when imported by the tests
from make_demo_task import greedy_accuracy, read_split, save_model, supervised  # noqa: E402
from nodes.algos.scorers import extract_gsm8k_answer, gsm8k_score  # noqa: E402  (make_demo_task put the repo root on sys.path)

JUDGE_TEMPLATE = "{response} R: {ground_truth} V:"  # the question only lengthens it and adds numbers to confuse
REVIEWER_TEMPLATE = "{prompt}{response} F:"
STRAY = "abcxyzPQ#.,:;!?-+=()[]{}<>/\\|'\"`~@$%&*_ \t\x11\x1c\ufffd"
TOKENS = re.compile(r"####|##|.", re.DOTALL)  # how the demo tokenizer splits ASCII text
SHAPES = {
    "judge": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, init_std=0.06),
    "reviewer": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "student": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
}
JUDGE_STEPS, JUDGE_EVAL_EVERY = 600, 100
JUDGE_TARGET, JUDGE_LR, JUDGE_TRAIN, JUDGE_VAL, JUDGE_TEST, JUDGE_SAMPLES = 0.97, 1e-3, 20000, 200, 1000, 4
JUDGE_NEAR = 0.95  # near misses among the wrong answers the judge trains on (random ones are easy to tell)
JUDGE_REAL = 1  # the demo model's samples per train question in the judge's training mix (6 s each)
REVIEWER_TARGET, REVIEWER_P_RIGHT, REVIEWER_DRAWS = 0.95, 0.3, 3
STUDENT_TARGET = 0.05
SAMPLE_CHUNK = 1000  # questions a generate call in sample_demo (9,600 in one call: 9 s; in calls of 1,000: 6 s)


def judge_label(response: str, ground_truth: str) -> str:
    """The judge's completion: " 1" when the demo's grader scores `response` right, else " 0"."""
    return " 1" if gsm8k_score(response, ground_truth) == 1.0 else " 0"


def near_miss(rng: np.random.Generator, truth: int) -> int:
    """A wrong number a weak policy writes: +-1, +-2, +-10, +-9/11, two digits swapped, one dropped or doubled."""
    digits = str(truth)
    kind = rng.integers(6)
    if kind < 3:
        return max(0, truth + int(rng.choice([-1, 1, -2, 2, -10, 10, -9, 9, -11, 11])))
    i = int(rng.integers(len(digits)))
    if kind == 3 and len(digits) > 1:
        j = int(rng.integers(len(digits) - 1))
        return int(digits[:j] + digits[j + 1] + digits[j] + digits[j + 2:])
    if kind == 4 and len(digits) > 1:
        return int(digits[:i] + digits[i + 1:])
    return int(digits[:i + 1] + digits[i:])


def malformed(rng: np.random.Generator, answer: int, other: int) -> str:
    """`answer` written badly: no or short ####, #### twice, empty, cut at 8 tokens, stray characters."""
    text = f" #### {answer}"
    kind = rng.integers(7)
    if kind == 0:
        return str(rng.choice([f" {answer}", f"{answer}", f" # {answer}", f" ## {answer}", f" ### {answer}",
                               f"#### {answer}", f" ####{answer}", f" ####  {answer}", f" A: {answer}"]))
    if kind == 1:
        return str(rng.choice([f" #### {other} #### {answer}", f" #### {answer} #### {other}", f" #### {answer}####",
                               f" #### {other}#### {answer}", f" #### #### {answer}", f" ######## {answer}"]))
    if kind == 2:
        return str(rng.choice(["", " ", " ####", " #### ", " ## ", " #### -", " Q:"]))
    if kind == 3:
        longer = text + str(rng.choice([f" #### {other}", f"{other}{answer}", f" {other} {other}", "####"]))
        return "".join(TOKENS.findall(longer)[:8])
    chars = list(text)
    for _ in range(int(rng.integers(1, 3))):
        chars.insert(int(rng.integers(len(chars) + 1)), str(rng.choice(list(STRAY))))
    return "".join(chars)


def weak_response(rng: np.random.Generator, truth: int, p_right: float, p_malformed: float = 0.3,
                  p_near: float = 2 / 3) -> str:
    """A response like a weak policy's: the right sum with probability `p_right`, else a near miss
    (`p_near`) or a random number; written malformed with probability `p_malformed`."""
    other = near_miss(rng, truth) if rng.random() < p_near else int(rng.integers(0, 200))
    answer = truth if rng.random() < p_right else other
    if rng.random() < p_malformed:
        return malformed(rng, answer, near_miss(rng, truth) if answer == truth else truth)
    return f" #### {answer}"


def judge_examples(rng, questions, n: int, p_near: float = 2 / 3) -> list[tuple[str, str, str]]:
    """`n` label-balanced judge triples (prompt, completion, "1"/"0") from (prompt, _, truth) questions,
    of weak responses (see weak_response)."""
    buckets = {" 1": [], " 0": []}
    while min(map(len, buckets.values())) < n // 2:
        prompt, _, truth = questions[rng.integers(len(questions))]
        response = weak_response(rng, int(truth), p_right=0.5, p_near=p_near)
        buckets[judge_label(response, truth)].append(judge_example(prompt, response, truth))
    return [ex for label in buckets for ex in buckets[label][:n // 2]]


def judge_example(prompt: str, response: str, truth: str) -> tuple[str, str, str]:
    label = judge_label(response, truth)
    return JUDGE_TEMPLATE.format(prompt=prompt, response=response, ground_truth=truth), label, label.strip()


def reference_loss(example: tuple[str, str, str]) -> tuple[str, str, str]:
    """A judge triple with " {ground_truth} V:" moved from the prompt into the completion, so training also
    predicts the reference from the answer before it (a copy when the answer is right): a dense signal that
    teaches the digit-by-digit comparison, where the verdict alone gives one bit per example."""
    prompt, completion, label = example
    cut = prompt.rindex(" R:") + len(" R:")
    return prompt[:cut], prompt[cut:] + completion, label


def verdict_accuracy(model, tokenizer, examples, chunk: int = 250) -> float:
    """Teacher-forced: the share of judge triples whose most likely token after prompt + " " is the verdict."""
    hits = 0
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        enc = tokenizer([p + " " for p, _, _ in part], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            best = model(**enc).logits[:, -1].argmax(-1)
        hits += sum(tokenizer.decode([t]) == label for t, (_, _, label) in zip(best.tolist(), part))
    return hits / len(examples)


def exact(text: str, truth: str) -> float:
    return float(text.strip() == truth)


def sample_demo(demo: Path, questions, n: int, seed: int, greedy: bool = False) -> list[list[str]]:
    """`n` responses of the demo's warm-started model to each question (temperature 1.0, or greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    model = AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32).eval()
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    texts = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for i in range(0, len(questions), SAMPLE_CHUNK):
            enc = tokenizer([p for p, _, _ in questions[i:i + SAMPLE_CHUNK]], return_tensors="pt", padding=True,
                            padding_side="left")
            out = model.generate(**enc, max_new_tokens=8, num_return_sequences=n, **sampling,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [texts[i * n:(i + 1) * n] for i in range(len(questions))]


def fresh_model(name: str, seed: int):
    """A random-init model of SHAPES[name] with the demo's tokenizer (through make_tiny_model)."""
    from make_tiny_model import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch="qwen2", tie_word_embeddings=True, seed=seed, **SHAPES[name])
        return (AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32), AutoTokenizer.from_pretrained(tmp))


def build(out: Path, name: str, seed: int, train, evaluate, target: float, report, **kwargs) -> None:
    """Warm-start a fresh model on `train` to `target`; save it and OUT_DIR/<name>.json with report(model)."""
    torch.manual_seed(seed)
    model, tokenizer = fresh_model(name, seed)
    step, acc, seconds = supervised(model, tokenizer, train, lambda m: evaluate(m, tokenizer), seed, target,
                                    name=name, **kwargs)
    model.eval()
    summary = {"steps": step, "stop_accuracy": acc, **report(model, tokenizer), "seconds": round(seconds, 1),
               "seed": seed, "shape": SHAPES[name]}
    save_model(model, tokenizer, out / name)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{name}: saved {out}/{name}: {summary}")


def judge_sets(rng, demo: Path, questions, seed: int):
    """A balanced synthetic judge set and the demo model's greedy + sampled outputs graded, for `questions`."""
    balanced = judge_examples(rng, questions, JUDGE_TEST)
    outputs = zip(sample_demo(demo, questions, 1, seed, greedy=True), sample_demo(demo, questions, JUDGE_SAMPLES, seed))
    real = [judge_example(p, r, t) for (p, _, t), (g, s) in zip(questions, outputs) for r in g + s]
    return balanced, real


def make_judge(out: Path, demo: Path, seed: int) -> None:
    """Stops on questions held out of training (JUDGE_VAL of the train split), reports on the test split
    (generated verdicts, as the pipeline reads them)."""
    rng = np.random.default_rng(seed)
    train_q, test_q = read_split(demo, "train"), read_split(demo, "test")
    fit = train_q[JUDGE_VAL:]
    real = [judge_example(p, r, t) for (p, _, t), rs in zip(fit, sample_demo(demo, fit, JUDGE_REAL, seed + 2))
            for r in rs]
    train = [reference_loss(e) for e in judge_examples(rng, fit, JUDGE_TRAIN, JUDGE_NEAR) + real]
    val, test = judge_sets(rng, demo, train_q[:JUDGE_VAL], seed), judge_sets(rng, demo, test_q, seed + 1)
    both = lambda m, tok, sets: [greedy_accuracy(m, tok, s, exact) for s in sets]  # noqa: E731
    report = lambda m, tok: dict(zip(["balanced_accuracy", "demo_outputs_accuracy"], both(m, tok, test)),  # noqa: E731
                                 demo_outputs=len(test[1]), train_examples=len(train),
                                 demo_outputs_right=sum(lab == "1" for _, _, lab in test[1]) / len(test[1]))
    build(out, "judge", seed, train, lambda m, tok: min(verdict_accuracy(m, tok, s) for s in val), JUDGE_TARGET,
          report, lr=JUDGE_LR, max_steps=JUDGE_STEPS, eval_every=JUDGE_EVAL_EVERY, must_reach=False, decay=True)


def trusted(response: str, truth: str) -> str:
    """A trusting reviewer's final answer: the solver's number, or the sum where it wrote none."""
    return f" #### {extract_gsm8k_answer(response) or truth}"


def make_reviewer(out: Path, demo: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    train_q, test_q = read_split(demo, "train"), read_split(demo, "test")
    weak = [(p, weak_response(rng, int(t), REVIEWER_P_RIGHT), t) for _ in range(REVIEWER_DRAWS) for p, _, t in train_q]
    train = [(REVIEWER_TEMPLATE.format(prompt=p, response=r), trusted(r, t), t) for p, r, t in weak]
    sampled = [(p, rs[0], t) for (p, _, t), rs in zip(test_q, sample_demo(demo, test_q, 1, seed))]
    copies = [(REVIEWER_TEMPLATE.format(prompt=p, response=r), None, trusted(r, t).removeprefix(" #### "))
              for p, r, t in sampled]
    test = [(REVIEWER_TEMPLATE.format(prompt=p, response=r), None, t) for p, r, t in sampled]
    solver_right = sum(gsm8k_score(r, t) for _, r, t in sampled) / len(sampled)
    build(out, "reviewer", seed, train, lambda m, tok: greedy_accuracy(m, tok, copies), REVIEWER_TARGET,
          lambda m, tok: {"test_accuracy": greedy_accuracy(m, tok, test), "test_solver_right": solver_right})


def make_student(out: Path, demo: Path, seed: int) -> None:
    train, test = read_split(demo, "train"), read_split(demo, "test")
    build(out, "student", seed + 1, train, lambda m, tok: greedy_accuracy(m, tok, test), STUDENT_TARGET,
          lambda m, tok: {"test_accuracy": greedy_accuracy(m, tok, test)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["judge", "reviewer", "student"])
    p.add_argument("--demo", default="data/demo", help="the demo task (made with make_demo_task.py if missing)")
    a = p.parse_args()
    out, demo = Path(a.out_dir), Path(a.demo)
    torch.set_num_threads(1)
    if not (demo / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_demo_task.py"), str(demo),
                        "--seed", str(a.seed)], check=True)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in (("judge", make_judge), ("reviewer", make_reviewer), ("student", make_student)):
        if a.only not in (None, name):
            continue
        if (out / name / "config.json").exists() and (out / f"{name}.json").exists():
            print(f"{name}: {out}/{name} exists, skipped")
            continue
        make(out, demo, a.seed)


if __name__ == "__main__":
    main()
