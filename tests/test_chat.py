"""`tuneledger chat` and `tuneledger eval`: what they load, that chat streams and stops, that eval's
loss is transformers' own, and a real model that answers with the name it was taught."""

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

import procs

ROOT = Path(__file__).resolve().parents[1]


def tl(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return procs.run([sys.executable, "-m", "tuneledger", *args], cwd=cwd, env=env)


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, tiny_model):
    """A run folder as `tuneledger train` leaves it (job.json, checkpoint-1 with a LoRA adapter), with
    a random non-zero adapter so that it changes the model's output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tuneledger.config_load import load_config

    run = tmp_path_factory.mktemp("chat") / "run"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    ckpt = run / "checkpoint-1"
    peft.save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"model_name_or_path={tiny_model}", "cutoff_len=64",
                                                        f"cache_dir={run.parent / 'cache'}", "default_system=Be brief."])
    (run / "job.json").write_text(json.dumps({"mode": "train", "config": cfg.model_dump()}))
    # Sealed as a training's save leaves it (checkpoints.py): the optimizer and scheduler files are
    # stand-ins, chat never reads them.
    from tuneledger.checkpoints import CONFIG, write_manifest

    for name in ("optimizer.pt", "scheduler.pt"):
        torch.save({}, ckpt / name)
    (ckpt / CONFIG).write_text(json.dumps(cfg.model_dump()))
    write_manifest(ckpt, 1)
    return run


def test_loads_base_plus_adapter_and_stops_at_im_end(adapter_run, tiny_model, capsys):
    from tuneledger.chat import reply
    from tuneledger.loading import load, stop_ids

    loaded = load(str(adapter_run), device="cpu")
    assert loaded.source == f"{tiny_model} + adapter {adapter_run / 'checkpoint-1'}"
    assert loaded.config["default_system"] == "Be brief."
    assert 151645 in stop_ids(loaded.tokenizer)  # <|im_end|>
    text = reply(loaded, [{"role": "user", "content": "hello"}], max_new_tokens=6)
    streamed = capsys.readouterr().out
    assert text and text.strip() in streamed.strip()  # the answer was streamed to the terminal as it came


def test_chat_cli_one_prompt_and_clear_errors(adapter_run, tmp_path):
    p = tl("chat", str(adapter_run), "--prompt", "who are you?", "--max-new-tokens", "5", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "chat: " in p.stderr and "+ adapter" in p.stderr and p.stdout.strip()
    assert f"+ adapter {adapter_run / 'checkpoint-1'} (step 1)\n" in p.stderr  # the adapter's step, too
    assert "SYNTHETIC model (random weights)" in p.stderr  # the tiny model: noise is expected, and said
    p = tl("chat", str(tmp_path / "no-such-run"), "--prompt", "x")
    assert p.returncode == 2 and "no run" in p.stderr and "no-such-run" in p.stderr
    p = tl("chat", str(adapter_run), "--checkpoint", "best", "--prompt", "x")
    assert p.returncode == 1 and "has no checkpoint with an eval loss" in p.stderr


def test_chat_on_an_export_names_the_checkpoint_step_and_base_it_was_made_from(adapter_run, tiny_model, tmp_path):
    """Issue 21 (1): export records its provenance in export.json beside the weights; chat's first
    line names it. A real export of the run's checkpoint-1, then chat on the export folder."""
    from tuneledger.export import export

    out = tmp_path / "export"
    led = export(adapter_run, out, device="cpu", max_new_tokens=4)
    recorded = json.loads((out / "export.json").read_text())
    assert (recorded["checkpoint"], recorded["step"], recorded["base"]) == (
        str(adapter_run / "checkpoint-1"), 1, str(tiny_model)) and recorded == json.loads(json.dumps(led))
    p = tl("chat", str(out), "--prompt", "hi", "--max-new-tokens", "3", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.splitlines()[0] == (f"chat: export {out} (exported from {adapter_run / 'checkpoint-1'}, step 1; "
                                        f"base {tiny_model})"), p.stderr[-3000:]


def test_the_start_line_says_where_the_model_came_from_in_every_case(tmp_path):
    """An export.json from before the step was recorded: the step from the checkpoint's name; a model
    folder without one: said; an adapter: its trainer_state's step, else its name's."""
    from tuneledger.loading import checkpoint_step, provenance

    old = tmp_path / "old-export"
    old.mkdir()
    (old / "export.json").write_text(json.dumps({"checkpoint": "runs/x/checkpoint-40", "base": "models/b"}))
    assert provenance("export", old) == "exported from runs/x/checkpoint-40, step 40; base models/b"
    assert provenance("export", tmp_path) == ("no export.json beside it: the run and checkpoint it was made from "
                                              "are not recorded")
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    assert checkpoint_step(ckpt) == 7 and provenance("adapter", ckpt) == "step 7"
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 8}))
    assert checkpoint_step(ckpt) == 8
    assert checkpoint_step(tmp_path / "best") is None and provenance("adapter", tmp_path / "best") == ""


def eval_args(items, **kw):
    base = dict(items=items, dataset=None, checkpoint=None, base=None, batch_size=None, max_samples=None, out=None,
                device="cpu", predict=False, max_new_tokens=None)
    return argparse.Namespace(**{**base, **kw})


def test_eval_loss_is_transformers_loss_and_writes_json(adapter_run, tmp_path, capsys):
    import torch

    from tuneledger import evaluate
    from tuneledger.loading import load
    from tuneledger.data import encode, to_messages

    records = [{"instruction": "2+2?", "output": "4, of course."}, {"instruction": "Name a colour.", "output": "Blue."},
               {"instruction": "", "output": "x"}]  # invalid: counted, not scored
    data = tmp_path / "heldout.json"
    data.write_text(json.dumps(records))
    out = tmp_path / "r.json"
    args = eval_args([str(adapter_run)], dataset=[str(data)], batch_size=2, out=str(out))
    assert evaluate.run(args) == 0
    line = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["records"], result["scored"], result["invalid"]) == (3, 2, 1)
    assert f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}" in line
    assert math.isclose(result["perplexity"], math.exp(result["loss"]))

    # Independently: transformers' own loss of the PEFT model, token-weighted over both records.
    loaded = load(str(adapter_run), device="cpu")
    nll, n = 0.0, 0
    for r in records[:2]:
        enc = encode(to_messages(r, "t"), loaded.tokenizer, 64, default_system="Be brief.")
        ids, labels = torch.tensor([enc["input_ids"]]), torch.tensor([enc["labels"]])
        with torch.no_grad():
            loss = loaded.model(input_ids=ids, labels=labels).loss.item()
        k = int((labels[:, 1:] != -100).sum())
        nll, n = nll + loss * k, n + k
    assert result["supervised_tokens"] == n
    assert math.isclose(result["loss"], nll / n, rel_tol=1e-4)


def test_chat_reads_a_llamafactory_inference_yaml(adapter_run, tiny_model, tmp_path):
    """LLaMA-Factory's examples/inference/*_lora_sft.yaml: model + adapter + template + backend."""
    cfg = tmp_path / "infer.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model}\nadapter_name_or_path: {adapter_run / 'checkpoint-1'}\n"
                   "template: llama3\ninfer_backend: huggingface\ntrust_remote_code: true\nmax_new_tokens: 4\n")
    p = tl("chat", str(cfg), "--prompt", "hi", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"chat: {tiny_model} + adapter {adapter_run / 'checkpoint-1'}" in p.stderr
    # The asked template differs from the tokenizer's own: said, not silently rendered as ChatML.
    assert "template: WARNING llama3 asks for Llama 3, but the tokenizer's own chat template" in p.stderr
    assert "(ChatML) is what renders" in p.stderr
    assert "trust_remote_code: no effect" in p.stderr and "infer_backend: chat runs transformers' generate" in p.stderr
    assert "resum" not in p.stderr  # adapter_name_or_path means the adapter here, not a training resume
    cfg.write_text(f"model_name_or_path: {tiny_model}\nadapter_name_or_path: a,b\ninfer_backend: vllm\n")
    p = tl("chat", str(cfg), "--prompt", "hi")
    assert p.returncode == 2, p.stderr
    assert f"2 problems in {cfg}" in p.stderr and f"{cfg}:2: adapter_name_or_path: 'a,b'" in p.stderr
    assert f"{cfg}:3: infer_backend: 'vllm' is not supported by `tuneledger chat`" in p.stderr
    assert "docker compose --profile serve up serve" in p.stderr


def test_eval_predict_yaml_writes_llamafactory_predictions(adapter_run, tiny_model, tmp_path, capsys):
    """LLaMA-Factory's predict yaml (examples/extras/nlg_eval): do_predict + predict_with_generate
    generate greedily on eval_dataset; generated_predictions.jsonl holds prompt/predict/label per
    record, predict_results.json the loss, the same as a plain eval's."""
    from tuneledger import evaluate
    from tuneledger.chat import reply
    from tuneledger.loading import load

    records = [{"instruction": "2+2?", "output": "4."}, {"instruction": "Name a colour.", "output": "Blue."},
               {"instruction": "", "output": "x"}]  # invalid: neither scored nor predicted
    data = tmp_path / "heldout.json"
    data.write_text(json.dumps(records))
    out = tmp_path / "predict"
    cfg = tmp_path / "predict.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model}\nadapter_name_or_path: {adapter_run}\nstage: sft\n"
                   f"do_predict: true\nfinetuning_type: lora\neval_dataset: {data}\ntemplate: qwen\ncutoff_len: 64\n"
                   "max_samples: 50\noverwrite_cache: true\npreprocessing_num_workers: 1\n"
                   f"output_dir: {out}\noverwrite_output_dir: true\nper_device_eval_batch_size: 1\n"
                   "predict_with_generate: true\nmax_new_tokens: 3\nddp_timeout: 180000000\n")
    assert evaluate.run(eval_args([str(cfg)])) == 0
    line = capsys.readouterr().out
    assert "2 greedy predictions (at most 3 new tokens each)" in line
    # A fresh tester's 8 CPU predictions ran 6 min with no line: now the first and the last say so.
    assert re.search(r"predict: 1/2 replies, \d+ new tokens in \d+\.\d s; ~\d+ min \d\d s more\n", line), line
    assert re.search(r"predict: 2/2 replies, \d+ new tokens in \d+\.\d s\n", line), line
    rows = [json.loads(r) for r in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == ["4.", "Blue."] and all(set(r) == {"prompt", "predict", "label"} for r in rows)
    assert rows[0]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the run's system prompt
    assert rows[0]["prompt"].endswith("<|im_start|>assistant\n") and "2+2?" in rows[0]["prompt"]
    result = json.loads((out / "predict_results.json").read_text())
    assert result["predict_loss"] == result["loss"] and result["max_new_tokens"] == 3

    # Independently: chat's own greedy reply to the same message, and a plain eval's loss.
    loaded = load(str(adapter_run), device="cpu")
    assert rows[0]["predict"].strip() == reply(loaded, [{"role": "user", "content": "2+2?"}], 3, stream=False)
    plain = tmp_path / "plain.json"
    assert evaluate.run(eval_args([str(adapter_run)], dataset=[str(data)], out=str(plain))) == 0
    assert math.isclose(json.loads(plain.read_text())["loss"], result["loss"], rel_tol=1e-6)
    assert not (tmp_path / "generated_predictions.jsonl").exists()  # no predictions without do_predict


def test_benchmark_eval_yaml_gets_one_line(tmp_path):
    """LLaMA-Factory's examples/train_lora/llama3_lora_eval.yaml (task: mmlu_test): one sentence."""
    cfg = tmp_path / "mmlu.yaml"
    cfg.write_text("model_name_or_path: m\nadapter_name_or_path: saves/x\ntrust_remote_code: true\nfinetuning_type: lora\n"
                   "task: mmlu_test\ntemplate: fewshot\nlang: en\nn_shot: 5\nsave_dir: saves/eval\nbatch_size: 4\n")
    for verb in ("eval", "train"):
        p = tl(verb, str(cfg))
        assert p.returncode == 2, p.stderr
        msg = p.stderr.strip()
        assert len(msg.splitlines()) == 1 and "unknown key" not in msg, msg
        assert "task: mmlu_test" in msg and "benchmark evals" in msg and "not supported" in msg
        assert "lm-evaluation-harness" in msg and "tuneledger export" in msg


@pytest.mark.e2e
@pytest.mark.slow
def test_real_model_answers_with_its_new_name(smollm2_identity_run):
    """SmolLM2-135M-Instruct (real weights) fine-tuned on identity.json (conftest's shared run, as
    tests/test_export.py uses it); `tuneledger chat --prompt` answers with the name it learnt, and stops."""
    base, run = smollm2_identity_run
    p = tl("chat", str(run), "--prompt", "who are you?", "--max-new-tokens", "64", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Ledgerly" in p.stdout, p.stdout
    assert "SYNTHETIC" not in p.stderr  # real weights
    from transformers import AutoTokenizer

    n_tokens = len(AutoTokenizer.from_pretrained(base)(p.stdout.strip())["input_ids"])
    assert n_tokens < 64, p.stdout  # it stopped at <|im_end|>, not at the token limit
