"""The hostile corpus (tests/hostile.py) on every route a user hands a file to clipdist by: one verdict per file.

- **refused** (it would run code, or read outside its checkpoint, or is a link or a special file): one line
  `error: ... refused ...`, exit 2, the marker never appears, nothing started — and under resume=auto never
  skipped for an older checkpoint, never a fresh start;
- **damaged** (a missing shard, an item past its file's end, a truncated progress file): resume=auto says so and
  continues from the older checkpoint; resume=<it>, export (either format) and eval say so in one line.

Every case is bounded in time (a FIFO, /dev/zero) by the check itself: nothing is opened before it is known to
be a regular file inside the folder."""

from __future__ import annotations

import inspect
import os
import shutil

import pytest
from fixtures import caption_shards
from helpers import read_jsonl, refusal, train
from hostile import hostile_checkpoints, pickle_files, place

from clipdist.checkpoint.run_dir import foreign_entries
from clipdist.cli import main as cli


@pytest.fixture(scope="module")
def corpus(trained_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    marker = folder / "code-ran"
    files = pickle_files(folder / "files", marker)
    checkpoints = hostile_checkpoints(trained_run / "checkpoints" / "step_00000030.dcp", folder / "runs", marker)
    evalset = caption_shards(folder / "evalset", shards=1, per_shard=4)
    assert not marker.exists()
    yield files, checkpoints, marker, evalset
    assert not marker.exists(), "a hostile file ran its code"


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def one_refusal(lines: list[str]) -> None:
    assert len(lines) == 1 and "error: " in lines[0] and "refused" in lines[0], lines
    assert "\x1b" not in lines[0] and "\x07" not in lines[0], lines  # a file's text cannot drive the terminal


FILES = [
    "global",
    "stack_global",
    "protocol_5",
    "inst",
    "obj",
    "numpy_object",
    "partial",
    "getattr_chain",
    "ext1",
    "escapes",
]


@pytest.mark.parametrize("container", ["zip", "raw"])
@pytest.mark.parametrize("shape", FILES)
def test_a_weights_file_of_any_pickle_shape_is_refused_on_every_route(
    corpus, tmp_path, cache_dir, capsys, monkeypatch, shape, container
):
    files, _, marker, evalset = corpus
    path = files[f"{shape}-{container}"]
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"model.checkpoint={path}"
    )
    assert code == 2 and not marker.exists()
    one_refusal(lines)
    assert cli(["eval", str(path), "--model", "clipdist-tiny", "--set", f"val={evalset}"]) == 2
    one_refusal(lines_of(capsys.readouterr().err))
    assert not marker.exists()
    if shape == "escapes":
        assert "\\x1b[2J" in lines[0]  # shown, escaped


REFUSED = [
    "progress-global",
    "progress-stack_global",
    "progress-inst",
    "progress-numpy_object",
    "progress-escapes",
    "config-interpolation",
    "config-bomb",
    "path-parent",
    "path-absolute",
    "shard-symlink",
    "shard-dev-zero",
    "progress-fifo",
    "metadata-symlink",
]
DAMAGED = ["shard-missing", "item-past-end", "progress-truncated"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", REFUSED)
def test_a_hostile_checkpoint_is_refused_on_every_route(
    corpus, trained_run, tmp_path, cache_dir, capsys, monkeypatch, name
):
    _, checkpoints, marker, evalset = corpus
    checkpoint, verdict = checkpoints[name]
    assert verdict == "refused"
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"resume={checkpoint}"
    )
    assert code == 2
    one_refusal(lines)
    run_dir = checkpoint.parent.parent
    for export_format in ("open_clip", "transformers"):
        assert cli(["export", str(run_dir), "--out", str(tmp_path / "out"), "--format", export_format]) == 2
        one_refusal(lines_of(capsys.readouterr().err))
        assert not (tmp_path / "out").exists()
    assert cli(["eval", str(run_dir), "--set", f"val={evalset}"]) == 2
    one_refusal(lines_of(capsys.readouterr().err))
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'student'}",
        f"data.cache_dir={cache_dir}",
        f"loss.distill.model={run_dir}",
    )
    assert code == 2
    one_refusal(lines)
    # dropped into a real run as its newest checkpoint: refused, not skipped for the older one, no fresh start
    run = tmp_path / "dropped"
    shutil.copytree(trained_run, run)
    place(checkpoint, run / "checkpoints" / "step_00000040.dcp")
    code, lines = refusal(capsys, monkeypatch, f"run_dir={run}", f"data.cache_dir={cache_dir}", "optim.max_steps=50")
    assert code == 2
    one_refusal(lines)
    assert not marker.exists()


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_checkpoint_is_said_in_one_line_and_resume_auto_refuses_it(
    corpus, trained_run, tmp_path, cache_dir, capsys, monkeypatch, name
):
    _, checkpoints, _, evalset = corpus
    checkpoint, verdict = checkpoints[name]
    assert verdict == "damaged"
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"resume={checkpoint}"
    )
    assert code == 2 and len(lines) == 1 and "cannot be read" in lines[0], lines
    for export_format in ("open_clip", "transformers"):
        assert cli(["export", str(checkpoint), "--out", str(tmp_path / "out"), "--format", export_format]) == 2
        assert len(lines_of(capsys.readouterr().err)) == 1
    monkeypatch.undo()  # refusal's stand-ins for the trainer: this run trains
    run = tmp_path / "run-with-damage"
    shutil.copytree(trained_run, run)
    place(checkpoint, run / "checkpoints" / "step_00000040.dcp")
    logged = (run / "train_log.jsonl").read_bytes()
    result = train(run, cache_dir, "optim.max_steps=32", "eval_every=1000", "checkpoint_every=1000")
    assert result.returncode != 0, result.stderr[-3000:]  # refused: never a quiet fall back or a fresh start
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert "step_00000040.dcp cannot be read" in errors[-1] and "resume=" in errors[-1], errors[-3:]
    assert (run / "train_log.jsonl").read_bytes() == logged  # nothing overwritten


def test_escapes_in_a_refused_name_reach_no_console_or_log_raw(corpus, tmp_path, cache_dir, capsys, monkeypatch):
    _, checkpoints, _, _ = corpus
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        f"resume={checkpoints['progress-escapes'][0]}",
    )
    assert code == 2 and "\x1b" not in lines[0] and "\\x1b[2J" in lines[0]  # the name shown, escaped
    run_log = tmp_path / "run" / "train.log"
    assert not run_log.exists() or "\x1b" not in run_log.read_text()


def test_a_saved_interpolation_is_never_resolved(corpus, tmp_path, capsys, monkeypatch):
    """`${oc.env:...}` in a checkpoint's saved model.name: refused, and the reader's secret appears nowhere."""
    _, checkpoints, _, evalset = corpus
    monkeypatch.setenv("CLIPDIST_SECRET", "s3cr3t-value")
    run_dir = checkpoints["config-interpolation"][0].parent.parent
    assert cli(["eval", str(run_dir), "--set", f"val={evalset}"]) == 2
    err = capsys.readouterr().err
    assert "s3cr3t-value" not in err and "interpolation" in err


def test_a_saved_hub_model_is_read_from_the_cache_only(corpus, tmp_path, cache_dir, capsys, monkeypatch):
    """A run whose saved model.name is `hf-hub:...` (a copied run directory): evaluating, exporting or distilling
    from it fetches nothing — one line saying how to fetch it on purpose — and no hub request is made."""
    import huggingface_hub.file_download as download

    def no_request(*args, **kwargs):
        raise AssertionError("a request to the hub")

    monkeypatch.setattr(download, "get_hf_file_metadata", no_request)
    _, checkpoints, _, evalset = corpus
    run_dir = checkpoints["config-hf-hub"][0].parent.parent
    assert cli(["eval", str(run_dir), "--set", f"val={evalset}"]) == 2
    assert cli(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    lines = lines_of(capsys.readouterr().err)
    code, more = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'student'}",
        f"data.cache_dir={cache_dir}",
        f"loss.distill.model={run_dir}",
    )
    lines += more
    assert code == 2 and len(lines) == 3, lines
    assert all("hf-hub:clipdist-test/uncached is a hub model not in" in line for line in lines), lines


RUN_RECORDS = ["train.log", "metrics.jsonl", "wandb_id", "hydra/config.yaml", "checkpoints/step_00000030.dcp"]


@pytest.mark.parametrize("record", RUN_RECORDS)
def test_a_run_directory_whose_records_are_links_is_refused(
    trained_run, tmp_path, cache_dir, capsys, monkeypatch, record
):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "secret").write_text("do not touch\n")
    link = run / record
    if link.is_dir():
        shutil.rmtree(link)
    link.unlink(missing_ok=True)  # wandb_id: written by a W&B run; planted all the same
    link.symlink_to(target / "secret")
    code, lines = refusal(capsys, monkeypatch, f"run_dir={run}", f"data.cache_dir={cache_dir}", "optim.max_steps=40")
    assert code == 2 and len(lines) == 1 and "is a symbolic link" in lines[0] and record in lines[0], lines
    assert (target / "secret").read_text() == "do not touch\n"


def test_a_run_directory_others_can_write_is_refused(trained_run, tmp_path, cache_dir, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    run.chmod(0o777)
    code, lines = refusal(capsys, monkeypatch, f"run_dir={run}", f"data.cache_dir={cache_dir}", "optim.max_steps=40")
    assert code == 2 and len(lines) == 1 and "other users can write" in lines[0], lines


def test_a_folder_of_other_files_is_no_run_directory(trained_run, tmp_path, cache_dir, capsys, monkeypatch):
    """run_dir=<a folder of the user's own> wrote checkpoints, logs and report.png among (and over) its files:
    refused, nothing written; a run's own folder (its record there) and a new or empty one start."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (mine / "report.png").write_bytes(b"my picture")
    code, lines = refusal(capsys, monkeypatch, f"run_dir={mine}", f"data.cache_dir={cache_dir}")
    assert code == 2 and len(lines) == 1, lines
    assert f"run_dir={mine} holds files no run wrote (notes.txt) and no run's record" in lines[0], lines
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "report.png"]
    assert (mine / "report.png").read_bytes() == b"my picture"
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "notes.txt").write_text("a note beside a run\n")
    assert foreign_entries(run) == [] and foreign_entries(tmp_path / "new") == []
    (tmp_path / "empty").mkdir()
    assert foreign_entries(tmp_path / "empty") == []


def test_the_outputs_a_run_folder_may_hold_are_the_writers_names():
    from clipdist.checkpoint import compile_cache
    from clipdist.checkpoint.run_dir import BUG_FILE, OUTPUTS
    from clipdist.errors import report_bug
    from clipdist.tools import report

    assert {report.PICTURE, report.SUMMARY, compile_cache.FOLDER} <= set(OUTPUTS)
    assert BUG_FILE in inspect.getsource(report_bug)


def test_credentials_in_a_remote_url_are_refused_and_never_written(tmp_path, cache_dir, capsys, monkeypatch):
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        "checkpoint.remote=s3://AKIAKEY:wJalrSECRET@bucket/runs/x",
    )
    assert code == 2 and len(lines) == 1 and "holds credentials" in lines[0], lines
    assert "wJalrSECRET" not in lines[0] and "AKIAKEY" not in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("remote", ["s3:/bucket/runs/x", "pipe:echo", "runs/copies"])
def test_a_remote_that_is_a_relative_folder_is_refused(tmp_path, cache_dir, capsys, monkeypatch, remote):
    """`s3:/bucket` (one slash) has no protocol for fsspec: the copies went to ./s3:/bucket on this node, the run
    thinking itself safe off it."""
    monkeypatch.chdir(tmp_path)
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"checkpoint.remote={remote}"
    )
    assert code == 2 and len(lines) == 1, lines
    assert f"checkpoint.remote={remote}: neither a URL (protocol://...) nor an absolute path" in lines[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def bomb_files(tmp_path_factory):
    from hostile import bombs

    return bombs(tmp_path_factory.mktemp("bombs"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, message",
    [
        ("zip-bomb", "decompression bomb"),
        ("safetensors-huge-header", "more tensors than any model has"),
        ("safetensors-malformed", "cannot be read as safetensors"),
        ("fifo", "not a regular file"),
    ],
)
def test_a_weights_file_that_is_a_bomb_is_one_line_at_once(
    bomb_files, tmp_path, cache_dir, capsys, monkeypatch, name, message
):
    path = bomb_files[name]
    if name == "fifo":
        path = path.with_name("weights.pt")
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"model.checkpoint={path}"
    )
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_tar_member_larger_than_any_sample_skips_its_shard_without_reading_it(bomb_files):
    from clipdist.data.tar_samples import TruncatedShardError, tar_files

    with open(bomb_files["tar-huge-member"], "rb") as stream, pytest.raises(TruncatedShardError, match="more than any"):
        list(tar_files(stream))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "templates, message",
    [
        (["{:>500000000}"], "has the field {:>500000000}"),
        (["a {x} photo"], "has the field {x}"),
        (["{0.__class__}"], "has the field {0.__class__}"),
        (["a {", "b"], "is not a template"),
        (["a photo of {}.", "a photo"], "'a photo' does not name its class"),  # every class one prompt: chance
    ],
)
def test_a_template_that_is_not_a_class_slot_is_one_line(corpus, trained_run, capsys, templates, message):
    *_, evalset = corpus
    arguments = [argument for template in templates for argument in ("--templates", template)]
    assert cli(["eval", str(trained_run), "--set", f"val={evalset}", "--classnames", "a,b", *arguments]) == 2
    lines = lines_of(capsys.readouterr().err)
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.timeout(120)
def test_special_files_beside_an_eval_set_or_in_a_table_neither_hang_nor_fill_memory(
    corpus, trained_run, tmp_path, cache_dir, capsys
):
    from fixtures import image_bytes

    *_, evalset = corpus
    folder = tmp_path / "set"
    shutil.copytree(evalset, folder)
    os.mkfifo(folder / "zeroshot_classification_templates.txt")
    assert cli(["eval", str(trained_run), "--set", f"val={folder}"]) == 2
    lines = lines_of(capsys.readouterr().err)
    assert len(lines) == 1 and "not a regular text file" in lines[0], lines
    rows = ["filepath\ttitle"]
    for index in range(6):
        (tmp_path / f"{index}.png").write_bytes(image_bytes(20 * index))
        rows.append(f"{tmp_path / f'{index}.png'}\ta square {index}")
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    rows += [f"{tmp_path / 'fifo.png'}\ta pipe", f"{tmp_path / 'zero.png'}\tendless zeros"]
    (tmp_path / "table.tsv").write_text("\n".join(rows) + "\n")
    result = train(
        tmp_path / "run",
        cache_dir,
        "data=webdataset",
        f"data.train_shards={tmp_path / 'table.tsv'}",
        "data.workers=0",
        "world.batch_per_device=6",
        "optim.max_steps=2",
        "eval_every=1000",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_jsonl(tmp_path / "run" / "train_log.jsonl")[-1]["skipped_samples"] >= 2  # a whole epoch was read
    assert "not a regular file" in result.stderr


@pytest.mark.timeout(300)
def test_a_damaged_log_in_a_resumed_run_is_repaired_not_a_traceback(trained_run, tmp_path, cache_dir):
    """A line torn by a crash mid-write, or text that is not a step's row, in train_log.jsonl / metrics.jsonl: the
    resume drops it with one warning and logs on (it was a JSONDecodeError traceback)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for name in ("train_log.jsonl", "metrics.jsonl"):
        with open(run / name, "a") as log:
            log.write('not json at all\n[1, 2]\n{"no_step": 1}\n{"step": 31, "loss": 1.')  # the torn last line
    result = train(run, cache_dir, "optim.max_steps=31", "eval_every=30", "checkpoint_every=30", "resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "train_log.jsonl: 4 line(s) that are not a step's JSON row dropped" in result.stderr
    steps = [row["step"] for row in read_jsonl(run / "train_log.jsonl")]
    assert steps == sorted(steps) and steps[-1] == 31 and len(steps) == len(set(steps))


@pytest.mark.parametrize("route", ["export", "eval", "resume"])
def test_non_finite_weights_are_refused_by_export_eval_and_resume(
    trained_run, tmp_path, cache_dir, capsys, monkeypatch, route
):
    """A checkpoint whose weights were edited to NaN (the tensors rewritten through DCP, everything else intact):
    exported, evaluated or resumed, it is refused in one line — never written out as NaN weights, never trained on."""
    import torch.distributed.checkpoint as dcp

    from clipdist.checkpoint import weights

    source = trained_run / "checkpoints" / "step_00000030.dcp"
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    target = run_dir / "checkpoints" / source.name
    target.parent.mkdir()
    metadata = weights.SafeReader(str(source)).read_metadata()
    tops = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    state = weights.read_dcp(source, tops)
    name = next(key for key, value in state["model"].items() if value.is_floating_point() and value.numel() > 1)
    state["model"][name].view(-1)[0] = float("nan")
    with weights.single_process_quietly():
        dcp.save(state, checkpoint_id=str(target))
    shutil.copy(source / "progress.pt", target / "progress.pt")
    if route == "resume":  # read on every rank, in the ranks: a real start
        result = train(run_dir, cache_dir, "optim.max_steps=31")
        code, said = result.returncode, result.stderr
    else:
        evalset = f"val={cache_dir / 'digits' / 'val-000000.tar'}"
        arguments = (
            ["export", str(run_dir), "--out", str(tmp_path / "out")]
            if route == "export"
            else ["eval", str(run_dir), "--set", evalset]
        )
        code, said = cli(arguments), capsys.readouterr().err
    assert code in (1, 2) and "holds NaN or Inf" in said and "Traceback" not in said, said
    assert not (tmp_path / "out").exists()
