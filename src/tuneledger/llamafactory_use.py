"""What LLaMA-Factory keys mean in the verbs that use a trained model: export, chat and eval.

LLaMA-Factory's merge yaml (examples/merge_lora), inference yaml (examples/inference) and predict
yaml (do_predict: true) run as `tuneledger export|chat|eval CONFIG.yaml`. The same key can mean
another thing per verb (`adapter_name_or_path`: refused in training, the adapter to merge in
export); USE_RULES says what. A benchmark eval config (`task: mmlu_test`) gets one sentence naming
what to use instead. docs/llamafactory-keys.md's last section is generated from this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tuneledger.llamafactory import ONLY, REFUSED, Verdict, classify

# A key without a rule in a verb is judged as in a training config (classify); a training setting
# (a JobConfig field) is read by eval and ignored by export and chat.
USE_VERBS = ("export", "chat", "eval")


@dataclass
class UseRule:
    """One key in one verb: read (`meaning`), or ignored (`ignored`: `meaning` is why); refused at
    values where `accepted` is False, with `instead`."""

    meaning: str
    ignored: bool = False
    accepted: Callable[[Any], bool] | None = None
    instead: str = ""
    shown: str = ""  # the accepted values, for the docs


def _unset(v: Any) -> bool:
    return v in (None, "", [], False)


_ADAPTER = ("the adapter: a folder with adapter_config.json (LLaMA-Factory's output_dir, or a checkpoint-N) or a "
            "tuneledger run folder (its newest checkpoint); one adapter only")
_INT4 = ("INT4 is its own step here: `make export CONFIG=... QUANT=gptq` (or awq), or `tuneledger quantize --merged "
         "<export_dir> --scheme gptq` (4-bit W4A16)")
USE_RULES: dict[str, dict[str, UseRule]] = {
    "model_name_or_path": {
        "export": UseRule("the bf16 base the adapter is merged into (--base; default: the adapter's own record)"),
        "chat": UseRule("the base under the adapter, or the model itself without adapter_name_or_path (--base)"),
        "eval": UseRule("the base under the adapter, or the model itself without adapter_name_or_path (--base)")},
    "adapter_name_or_path": {
        "export": UseRule("the adapter to merge (--adapter): " + _ADAPTER, accepted=lambda v: "," not in str(v),
                          instead="one adapter per export: merge them one at a time", shown="one path"),
        "chat": UseRule("the adapter loaded on the base (the RUN argument): " + _ADAPTER, accepted=lambda v: "," not in str(v),
                        instead="one adapter at a time: chat with each in turn", shown="one path"),
        "eval": UseRule("the adapter scored (the RUN argument): " + _ADAPTER, accepted=lambda v: "," not in str(v),
                        instead="one adapter at a time: evaluate each in turn", shown="one path")},
    "template": {v: UseRule("checked against the tokenizer's own chat template, which is what renders "
                            "(a `template:` line says which format and why)") for v in USE_VERBS},
    "trust_remote_code": {v: UseRule("no effect: models load with transformers' own code", ignored=True)
                          for v in USE_VERBS},
    "export_dir": {"export": UseRule("where the merged model goes (--out)")},
    "export_size": {"export": UseRule("the shard size in GB (max_shard_size; tuneledger's default 2)",
                                      accepted=lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                                      instead="a whole number of GB above 0", shown="an int > 0")},
    "export_device": {"export": UseRule("cpu: merge and verify on the CPU (--device cpu); auto: on the GPU when there "
                                        "is one (without the key: the GPU when there is one)",
                                        accepted=lambda v: v in ("cpu", "auto"), instead="export_device: cpu or auto",
                                        shown="cpu, auto")},
    "export_legacy_format": {"export": UseRule("the export is safetensors", ignored=True, accepted=_unset,
                                               instead="the export is written as safetensors only (what transformers "
                                                       "and vLLM read); remove export_legacy_format", shown="false")},
    "export_quantization_bit": {"export": UseRule("no INT4 at export", ignored=True, accepted=_unset, instead=_INT4,
                                                  shown="unset")},
    "export_quantization_dataset": {"export": UseRule("no INT4 at export", ignored=True, accepted=_unset,
                                                      instead=_INT4 + "; its calibration data: --dataset FILES",
                                                      shown="unset")},
    "export_quantization_nsamples": {"export": UseRule("no INT4 at export", ignored=True, accepted=lambda v: v in (None, 128),
                                                       instead=_INT4 + "; its calibration records: --samples N",
                                                       shown="128")},
    "export_quantization_maxlen": {"export": UseRule("no INT4 at export", ignored=True, accepted=lambda v: v in (None, 1024),
                                                     instead=_INT4 + "; its calibration length: --seq-len N",
                                                     shown="1024")},
    "export_hub_model_id": {"export": UseRule("no upload", ignored=True, accepted=_unset,
                                              instead="upload the export yourself (huggingface-cli upload)", shown="unset")},
    "quantization_bit": {
        "export": UseRule("the merge goes into the bf16 base", ignored=True, accepted=_unset,
                          instead="merging into 4-bit weights rounds the update into the grid and wrecks the model; "
                                  "remove quantization_bit (the export merges into the bf16 base)", shown="unset"),
        "chat": UseRule("chat loads the base in bf16 (fp32 on CPUs)", ignored=True),
        "eval": UseRule("eval loads the base in bf16 (fp32 on CPUs)", ignored=True)},
    "infer_backend": {
        "chat": UseRule("chat runs transformers' generate", ignored=True,
                        accepted=lambda v: str(v).lower() in ("huggingface", "hf", "enginename.hf"),
                        instead="chat runs transformers' generate only; for vLLM, serve the export: `docker compose "
                                "--profile serve up serve`", shown="huggingface")},
    "infer_dtype": {v: UseRule("bf16 on GPUs, fp32 on CPUs", ignored=True, accepted=lambda v: v in (None, "auto"),
                               instead="the dtype is bf16 on GPUs, fp32 on CPUs; remove infer_dtype", shown="auto")
                    for v in ("chat", "eval")},
    "max_new_tokens": {"chat": UseRule("--max-new-tokens (default 256)"),
                       "eval": UseRule("tokens generated per record at most, with do_predict + predict_with_generate "
                                       "(--max-new-tokens; default 512)")},
    "do_sample": {"chat": UseRule("false: greedy (tuneledger's default); true: samples at `temperature`, 0.95 when unset"),
                  "eval": UseRule("generation is greedy", ignored=True, accepted=lambda v: not v,
                                  instead="predictions are greedy, so they repeat; remove do_sample", shown="false")},
    "temperature": {"chat": UseRule("--temperature, when do_sample is not false"),
                    "eval": UseRule("generation is greedy", ignored=True)},
    "default_system": {"chat": UseRule("the system prompt (default: the run's default_system)")},
    "do_predict": {"eval": UseRule("true with predict_with_generate: generate on eval_dataset and write "
                                   "generated_predictions.jsonl beside the loss (--predict)")},
    "predict_with_generate": {"eval": UseRule("with do_predict: true, generate (greedy) on eval_dataset (--predict)")},
    "do_eval": {"eval": UseRule("the loss is always computed", ignored=True)},
    "eval_dataset": {"eval": UseRule("the data scored (--dataset)")},
    "output_dir": {"eval": UseRule("where predict_results.json and generated_predictions.jsonl go (--out's folder); "
                                   "without adapter_name_or_path in a training config, also the run scored")},
    "per_device_eval_batch_size": {"eval": UseRule("records scored per forward pass (--batch-size)")},
}
for _k in ("top_p", "top_k", "num_beams", "repetition_penalty", "length_penalty", "skip_special_tokens"):
    USE_RULES[_k] = {v: UseRule("generation is greedy, or samples at temperature (chat) only", ignored=True)
                     for v in ("chat", "eval")}
for _k in ("run_name", "output_dir"):  # a training config: the run it trained
    USE_RULES.setdefault(_k, {}).update({v: UseRule("a training config: names the run used (its output_dir, else "
                                                    "runs/<run_name>) when adapter_name_or_path is not given")
                                         for v in ("export", "chat")})
USE_RULES["run_name"]["eval"] = USE_RULES["run_name"]["export"]
# LLaMA-Factory's `llamafactory-cli eval` keys (EvaluationArguments): a benchmark, not a data file.
BENCHMARK_KEYS = ("task", "task_dir", "n_shot", "lang", "save_dir")
BENCHMARK_INSTEAD = ("benchmark evals (MMLU, C-Eval, CMMLU) are not supported; merge the adapter (`tuneledger export "
                     "--adapter RUN`, or `tuneledger export` with a merge config) and run lm-evaluation-harness on its "
                     "export_dir: `lm_eval --model hf --model_args pretrained=<export_dir> --tasks mmlu --num_fewshot 5`; "
                     "loss and generations on your own data: `tuneledger eval` with eval_dataset")


def benchmark_eval(raw: dict) -> str | None:
    """One sentence for a benchmark eval config (`task: mmlu_test`, ...), else None."""
    found = [k for k in BENCHMARK_KEYS if k in raw]
    if not found:
        return None
    what = f"task: {raw['task']}" if "task" in raw else ", ".join(found)
    return f"a benchmark eval config ({what}; LLaMA-Factory's `llamafactory-cli eval`): {BENCHMARK_INSTEAD}"


def classify_use(verb: str, key: str, value: Any, fields: set[str]) -> Verdict | None:
    """The verdict on a key in a config given to export, chat or eval (`verb`), or None for a key
    no one knows. `fields` are JobConfig's: eval reads them as training does, export and chat ignore
    them (the model is used as trained)."""
    rule = USE_RULES.get(key, {}).get(verb)
    if rule is not None:
        if rule.accepted is not None and not rule.accepted(value):
            return Verdict("refused", rule.instead)
        return Verdict("ignored" if rule.ignored else "implemented", rule.meaning)
    if key in fields:
        if verb == "eval":
            return Verdict("implemented", "read as in training")
        return Verdict("ignored", f"a training setting: {verb} uses the model as it was trained")
    verdict = classify(key, value)
    if verdict is not None and verdict.status == "refused" and key not in REFUSED and key not in ONLY \
            and verb in ("chat", "export"):  # a setting of another kind of job: nothing to do here
        return Verdict("ignored", f"not read by `tuneledger {verb}` ({verdict.text})")
    return verdict


def use_table() -> list[str]:
    """The docs section on export, chat and eval configs: every key with a rule, per verb."""
    lines = ["", "## In export, chat and eval configs", "",
             "LLaMA-Factory's merge, inference and predict yamls run as `tuneledger export|chat|eval CONFIG.yaml` "
             "([llamafactory.md](llamafactory.md)). These keys mean there what the table says; any other key is "
             "judged as above, and a training setting is ignored by export and chat. A benchmark eval config "
             f"(`{'`, `'.join(BENCHMARK_KEYS)}`) gets one line: {BENCHMARK_INSTEAD}.", "",
             "| key | verb | status | meaning / instead |", "|---|---|---|---|"]
    for key in sorted(USE_RULES):
        for verb in USE_VERBS:
            rule = USE_RULES[key].get(verb)
            if rule is None:
                continue
            status = "ignored" if rule.ignored else "implemented"
            if rule.accepted is not None:
                status = f"{status} if {rule.shown}, else refused"
            note = rule.meaning + (f"; otherwise: {rule.instead}" if rule.accepted is not None else "")
            lines.append(f"| `{key}` | {verb} | {status} | {note.replace('|', '/')} |")
    return lines
