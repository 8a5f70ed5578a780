"""The Makefile's choices, read from `make -n` (prints the commands, runs nothing)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make_n(*args, env=None):
    import os

    p = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PATH": os.environ["PATH"], **(env or {})}, timeout=60)
    return p


def verb_line(out: str, verb: str) -> str:
    return next(line for line in out.splitlines() if f"tuneledger {verb} " in line)


def test_config_model_is_not_overridden_by_the_default(tmp_path):
    my = tmp_path / "my.yaml"
    my.write_text("model_name_or_path: /models/my-real-model\ndataset: x.json\n")
    p = make_n("stats", f"CONFIG={my}", "LOCAL=1")
    assert p.returncode == 0, p.stderr
    line = verb_line(p.stdout, "stats")
    assert "model_name_or_path" not in line  # the config's own model stands
    assert "synth-model" not in p.stdout  # and no synthetic model is built for it


def test_explicit_model_overrides_the_config(tmp_path):
    my = tmp_path / "my.yaml"
    my.write_text("model_name_or_path: /models/my-real-model\ndataset: x.json\n")
    for verb in ("stats", "dryrun", "train"):
        line = verb_line(make_n(verb, f"CONFIG={my}", "MODEL=/models/other", "LOCAL=1").stdout, verb)
        assert "model_name_or_path=/models/other" in line


def test_a_config_naming_a_synthetic_model_builds_it(tmp_path):
    my = tmp_path / "my.yaml"
    my.write_text("model_name_or_path: models/synthetic-tiny   # the tiny one\ndataset: x.json\n")
    p = make_n("dryrun", f"CONFIG={my}", "LOCAL=1")
    if (ROOT / "models" / "synthetic-tiny" / "config.json").is_file():
        pytest.skip("models/synthetic-tiny exists here, so make has nothing to build")
    assert "synth-model --arch tiny models/synthetic-tiny" in p.stdout


def test_default_config_runs_on_the_synthetic_model():
    p = make_n("stats", "LOCAL=1")
    line = verb_line(p.stdout, "stats")
    assert "model_name_or_path=models/synthetic-" in line


def test_make_test_does_not_talk_about_docker():
    p = make_n("test", env={"PATH": "/nonexistent:/usr/bin:/bin"})
    assert "Docker" not in p.stdout + p.stderr


def test_local0_without_compose_says_what_to_install(tmp_path):
    # A PATH with the few tools the Makefile itself calls and no docker / docker-compose.
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sed", "head", "mkdir", "cat", "env"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    p = subprocess.run([shutil.which("make"), "--no-print-directory", "stats", "LOCAL=0"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PATH": str(bin_dir)}, timeout=60)
    assert p.returncode != 0
    assert "docker-compose-plugin" in p.stderr and "LOCAL=1" in p.stderr
    assert "command not found" not in p.stderr


def test_user_data_folder_is_ignored_by_git():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    p = subprocess.run(["git", "check-ignore", "-q", "data/my-dataset.json"], cwd=ROOT)
    assert p.returncode == 0  # data/ (DATA_DIR's default) never gets committed by accident


def test_run_as_a_path_is_the_same_folder_for_the_verbs_that_write_and_those_that_read():
    """RUN=/data/x: train wrote runs//data/x (run_name=/data/x) while export read /data/x. Now the
    writing verbs get output_dir=RUN (and its last part as the run name); a name stays a name."""
    for verb in ("stats", "dryrun", "train"):
        line = verb_line(make_n(verb, "RUN=/data/x/", "LOCAL=1").stdout, verb)
        assert "output_dir=/data/x/ run_name=x" in line and "run_name=/data" not in line, line
        assert "run_name=my-run" in verb_line(make_n(verb, "RUN=my-run", "LOCAL=1").stdout, verb)
    assert "--adapter /data/x" in verb_line(make_n("export", "RUN=/data/x", "LOCAL=1").stdout, "export")


def test_a_run_name_that_is_a_path_is_refused():
    from tuneledger.config import ConfigError
    from tuneledger.config_load import load_config

    for bad in ("/tmp/x", "a/b", "..", " "):
        with pytest.raises(ConfigError, match="is not a folder name: a run name is one folder under runs/"):
            load_config(None, {"model_name_or_path": "m", "dataset": ["d.json"], "run_name": bad})


def test_export_chat_eval_reach_a_run_by_path_or_config(tmp_path):
    """RUN is a path when it holds a /, else runs/RUN; without RUN the verb reads CONFIG itself
    (its adapter_name_or_path / output_dir), and QUANT follows export_dir."""
    line = verb_line(make_n("export", "RUN=../elsewhere", "LOCAL=1").stdout, "export")
    assert "--adapter ../elsewhere" in line and "runs/../elsewhere" not in line
    assert "--adapter runs/my-run --checkpoint best" in verb_line(
        make_n("export", "RUN=my-run", "CHECKPOINT=best", "LOCAL=1").stdout, "export")
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: m\nadapter_name_or_path: saves/x/lora/sft\nexport_dir: saves/merged\n")
    p = make_n("export", f"CONFIG={lf}", "QUANT=awq", "LOCAL=1")
    assert f"tuneledger export {lf}" in verb_line(p.stdout, "export")
    assert "--merged saves/merged " in verb_line(p.stdout, "quantize")
    train = tmp_path / "train.yaml"
    train.write_text("model_name_or_path: m\ndataset: x.json\noutput_dir: saves/qwen/lora/sft\n")
    assert f"tuneledger chat {train}" in verb_line(make_n("chat", f"CONFIG={train}", "LOCAL=1").stdout, "chat")
    assert "--merged saves/qwen/lora/sft/export " in verb_line(
        make_n("quantize", f"CONFIG={train}", "LOCAL=1").stdout, "quantize")
    assert "tuneledger eval ../r --dataset h.json" in verb_line(
        make_n("eval", "RUN=../r", "DATASET=h.json", "LOCAL=1").stdout, "eval")


def test_local_verbs_echo_the_command_not_a_path_prefix():
    """Issue 21 (14): a PATH="..." prefix made make's echo a 100-character line before every verb."""
    out = make_n("dryrun", "LOCAL=1", "NPROC=2").stdout
    assert "PATH=" not in out
    line = verb_line(out, "dryrun")
    assert line.startswith(".venv/bin/tuneledger dryrun ") and "  " not in line  # no runs of blanks
    assert verb_line(make_n("train", "LOCAL=1", "ARGS=default_system='a  b'").stdout, "train").endswith(" default_system='a  b'")


def help_targets() -> list[str]:
    return re.findall(r"^([a-zA-Z0-9_./-]+):.*## ", (ROOT / "Makefile").read_text(), re.M)


def unquoted(line: str) -> str:
    """`line` without its quoted parts: blanks inside quotes are a value's or a message's own."""
    return re.sub(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"", "''", line)


@pytest.mark.parametrize("docker", [False, True], ids=["LOCAL=1", "container"])
def test_no_verb_echoes_runs_of_blanks(tmp_path, docker):
    """Issue 21 (6): an unset variable left two blanks in make's echo (`tuneledger export runs/r  `).
    Every target `make help` lists, with the optional variables unset and set, in the host venv and
    through Compose: no run of blanks between words and none at the end, outside quotes."""
    env = fake_docker(tmp_path, compose_v2=True) if docker else {}
    local = [] if docker else ["LOCAL=1"]
    settings = [[], ["RUN=r", "GGUF=x.gguf", "MODEL=m", "DATASET=d.json", "QUANT=awq", "CHECKPOINT=2", "PROMPT=hi",
                     "OUT=o", "NPROC=2", "PRESET=D", "MAX_STEPS=3", "STEPS=4", "UPGRADE=1", "QUANT_TORCH_INDEX=https://i"]]
    bad, seen = [], set()
    for target in help_targets():
        for extra in settings:
            p = make_n(target, *local, *extra, env=env)
            for line in p.stdout.splitlines():
                seen.add(target)
                text = unquoted(line).strip("\t")
                if re.search(r"\S {2,}\S", text) or text != text.rstrip():
                    bad.append(f"{target} {' '.join(extra)}: {line!r}")
    assert not bad, "\n".join(bad)
    assert {"stats", "dryrun", "train", "export", "chat", "eval", "quantize", "import-gguf", "lock"} <= seen
    # What is kept as given: a value with blanks in it.
    line = verb_line(make_n("chat", *local, "RUN=r", "PROMPT=a  b", env=env).stdout, "chat")
    assert line.endswith(' runs/r --prompt "a  b"'), line
    line = verb_line(make_n("quantize", *local, "RUN=r", "QUANT_ARGS=--samples 8", env=env).stdout, "quantize")
    assert line.endswith("--scheme awq --samples 8"), line


def test_help_columns_are_aligned_past_the_longest_target():
    """Issue 21 (5): `make monitor-stop stop and remove ...`, `make lock-check-quant fail if ...`."""
    p = subprocess.run(["make", "--no-print-directory", "help", "LOCAL=1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("  make ")]
    targets = help_targets()
    assert len(rows) == len(targets) and max(map(len, targets)) >= 16  # lock-check-quant
    column = {re.match(r"  make \S+ +", ln).end() for ln in rows}  # where each description starts
    assert len(column) == 1, rows
    width = max(map(len, targets))
    for target, ln in zip(targets, rows):
        assert ln.startswith(f"  make {target}  ") and ln[len("  make ") + width + 2] != " ", ln


def test_a_misspelt_command_line_variable_is_warned_with_the_close_one():
    p = make_n("dryrun", "LOCAL=1", "DATSET=x.json", "FOO=1")
    assert "DATSET (did you mean DATASET?), FOO: unknown to this Makefile, so it changes nothing" in p.stderr
    quiet = make_n("dryrun", "LOCAL=1", "DATASET=x.json", "HF_ENDPOINT=https://hf-mirror.com", "CUDA_VISIBLE_DEVICES=0")
    assert "unknown to this Makefile" not in quiet.stderr  # known ones, and environment-style names
    # what the compose files read reaches the image build and the containers through make's environment
    built = make_n("image", "LOCAL=1", "BASE_IMAGE=registry.example.cn/nvidia/cuda:12.1.1-cudnn8-runtime-ubuntu22.04",
                   "FLASH_ATTN_WHEEL_URL=", "SHM_SIZE=8g", "HTTPS_PROXY=http://proxy:3128")
    assert "unknown to this Makefile" not in built.stderr, built.stderr
    bench = make_n("bench", "LOCAL=1", "UNSLOTH_PROFILE=1", "PROFILE_RUN=", "PYTHONPATH=/opt/unsloth")  # bench/*.sh reads them
    assert "unknown to this Makefile" not in bench.stderr, bench.stderr


def test_the_bench_variables_passed_through_are_what_its_script_reads_and_its_recipe_leaves():
    """BENCH_ENV_VARS (not warned as unknown) is exactly what bench/h200_levers.sh takes from its
    environment (${NAME:-...}, ${NAME-...}, ${NAME:+...}) less what `make bench`'s recipe sets and the
    Makefile's own settings; a name that only another bench script reads (PRESETS=) is still warned."""
    make = (ROOT / "Makefile").read_text()
    listed = set(re.search(r"override BENCH_ENV_VARS := (.*)", make).group(1).split())
    recipe = make.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    set_by_recipe = set(re.findall(r"(?:^|[\s)])([A-Z_][A-Z0-9_]*)=", recipe))
    set_by_recipe.add("GPU_TEST_FILES")  # read only under GPU_TESTS=1, which the recipe turns off
    known = set(re.search(r"KNOWN_VARS := (.*?)(?<!\\)\n", make, re.S).group(1).replace("\\\n", " ").split())
    script = (ROOT / "bench" / "h200_levers.sh").read_text()
    read = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):?[-+]", script))
    assert listed == read - set_by_recipe - known, (listed, read - set_by_recipe - known)
    assert "PRESETS (did you mean PRESET?): unknown" in make_n("dryrun", "LOCAL=1", "PRESETS=B").stderr


def test_a_variable_the_makefile_computes_is_refused_on_the_command_line(tmp_path):
    """Set on the command line, make would let it replace what the Makefile computes (the job's
    model override, Docker's GPU facts): refused before anything runs, naming it."""
    for name in ("JOB_OVERRIDES", "DOCKER_GPU", "MODEL_OVERRIDE"):
        p = make_n("dryrun", "LOCAL=1", f"{name}=use_unsloth_gc=true")
        assert p.returncode != 0, p.stdout
        assert f"{name}: computed inside this Makefile, not a setting" in p.stderr, p.stderr
        assert 'key=value overrides go in ARGS="key=value ..."' in p.stderr
    assert make_n("dryrun", "LOCAL=1", "PRESET=B", "ARGS=use_unsloth_gc=true").returncode == 0
    # named once, and found with another makefile read first (MAKEFILES=); the check's own variables cannot turn it off
    p = make_n("dryrun", "LOCAL=1", "MODEL_OVERRIDE=x", env={"MAKEFILES": "/dev/null"})
    assert "tuneledger: MODEL_OVERRIDE: computed inside" in p.stderr and p.returncode != 0, p.stderr
    p = make_n("dryrun", "LOCAL=1", "INTERNAL_SET=", "INTERNAL_VARS=", "JOB_OVERRIDES=foo")
    assert p.returncode != 0 and "JOB_OVERRIDES" in p.stderr and " foo" not in p.stdout, (p.stdout, p.stderr)
    # `make -e` (or MAKEFLAGS=e) lets the environment replace what the Makefile computes: refused the same way
    for args, env in ((["-e"], {"JOB_OVERRIDES": "foo"}), ([], {"JOB_OVERRIDES": "foo", "MAKEFLAGS": "e"})):
        p = make_n(*args, "dryrun", "LOCAL=1", env=env)
        assert p.returncode != 0 and "JOB_OVERRIDES: computed inside" in p.stderr and " foo" not in p.stdout, (p.stdout, p.stderr)
    p = make_n("dryrun", "LOCAL=1", env={"JOB_OVERRIDES": "foo"})  # without -e the Makefile's own value wins
    assert p.returncode == 0 and " foo" not in p.stdout, (p.stdout, p.stderr)
    assert make_n("-e", "dryrun", "LOCAL=1", env={"PRESET": "B"}).returncode == 0  # a setting from the environment is fine
    # without -e, a computed name in the environment is not read where the Makefile leaves it unset
    # (the Docker facts under LOCAL=1 once made a CPU machine pick the 7B GPU job)
    import os

    no_gpu = tmp_path / "bin"  # an nvidia-smi that finds no GPU, on a GPU machine too
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (no_gpu / "nvidia-smi").chmod(0o755)
    p = make_n("dryrun", "LOCAL=1", env={"DOCKER_FACTS": "gpu=nvidia", "DOCKER_HAS_GPU": "1", "PATH": f"{no_gpu}:{os.environ['PATH']}"})
    assert p.returncode == 0 and "configs/tiny.yaml" in verb_line(p.stdout, "dryrun"), (p.stdout, p.stderr)


def fake_docker(tmp_path, compose_v2: bool) -> dict:
    """A PATH whose `docker` answers `info` (an engine, no GPU) and has the Compose v2 plugin or not;
    without it a `docker-compose` (v1, Debian 12's package) is there."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\ncase "$1" in info) echo "{}";; compose) exit %d;; esac\n' % (0 if compose_v2 else 1))
    (bin_dir / "docker").chmod(0o755)
    if not compose_v2:
        (bin_dir / "docker-compose").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "docker-compose").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TUNELEDGER_GPU": "none"}


@pytest.mark.parametrize("v2, compose", [(True, "docker compose"), (False, "docker-compose")])
def test_monitor_up_and_stop_use_either_compose_spelling(tmp_path, v2, compose):
    """Issue 21 (16): the sidecar detached and stopped by make, through whichever Compose is here."""
    env = fake_docker(tmp_path, v2)
    up = make_n("monitor-up", env=env)
    assert up.returncode == 0, up.stderr
    assert f"MONITOR_INTERVAL=5 {compose} up -d monitor" in up.stdout.splitlines()
    assert f"MONITOR_INTERVAL=2 {compose} up -d monitor" in make_n("monitor-up", "INTERVAL=2", env=env).stdout
    assert f"{compose} rm --stop --force monitor" in make_n("monitor-stop", env=env).stdout.splitlines()
    assert "tuneledger monitor --interval 5" in make_n("monitor", env=env).stdout  # the foreground sampler stays


def test_monitor_up_without_docker_says_what_to_run_instead():
    p = subprocess.run(["make", "--no-print-directory", "monitor-stop", "LOCAL=1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "`make monitor` samples in the foreground" in p.stdout


@pytest.mark.parametrize("target", ["stats", "monitor-up"])
def test_local0_with_the_engine_down_says_so_in_one_line(tmp_path, target):
    """A tester with docker installed and its daemon stopped: `make stats LOCAL=0` ended in
    docker-compose's 113-line traceback, `make monitor-up` said the image was missing."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    down = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
    for tool in ("docker", "docker-compose"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho '{down}' >&2\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    p = subprocess.run([shutil.which("make"), "--no-print-directory", target, "LOCAL=0"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=60)
    assert p.returncode != 0
    assert f"no Docker engine answers ({down}): start it (sudo systemctl start docker), or run in the host venv " \
           "with LOCAL=1." in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "no image" not in p.stderr


def test_whatif_passes_the_default_gpus_only_when_args_name_none(tmp_path):
    """`make whatif ARGS="--gpus 8xH100-sxm"` gives whatif one --gpus, not the default and then the user's."""
    own = verb_line(make_n("whatif", f"RUN={tmp_path}", "LOCAL=1", "ARGS=--gpus 8xH100-sxm").stdout, "whatif")
    assert own.count("--gpus") == 1 and "--gpus 8xH100-sxm" in own, own
    default = verb_line(make_n("whatif", f"RUN={tmp_path}", "LOCAL=1").stdout, "whatif")
    assert default.count("--gpus") == 1 and "--gpus 8x4090-pcie" in default, default


def test_local_is_1_or_0_and_empty_means_unset():
    """LOCAL=true or yes meant the container silently (only 1 is the venv): refused in one line, before
    anything runs; LOCAL= is unset (picked by whether Docker answers), as an empty value reads."""
    for bad in ("true", "yes"):
        p = make_n("dryrun", f"LOCAL={bad}")
        assert p.returncode == 2 and f"LOCAL={bad}: use LOCAL=1 (the host venv) or LOCAL=0 (the container)" in p.stderr, p.stderr
    p = make_n("dryrun", "LOCAL=1")
    assert p.returncode == 0 and "tuneledger dryrun " in p.stdout, p.stderr
    empty, unset = make_n("dryrun", "LOCAL="), make_n("dryrun")
    assert empty.returncode == unset.returncode == 0
    assert verb_line(empty.stdout, "dryrun") == verb_line(unset.stdout, "dryrun")
    p = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "LOCAL=1 the host venv, LOCAL=0 the container" in p.stdout and "BUDGET=10m" in p.stdout
