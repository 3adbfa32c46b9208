"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    namespace = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102
    assert namespace["count_params"](namespace["qwen3_4b"]) == 4_022_468_096


def test_readme_cli_commands_run_as_written(tiny_lm_run, tmp_path, capsys):
    """The README's commands, as written, on a tiny run: the main ``train`` line (with its
    experiment's ``:tiny`` twin), then ``eval``, ``plot`` and ``sample`` with DIR filled in."""
    import shlex
    import shutil

    from attnlab import experiment
    from attnlab.cli import main

    text = README.read_text()
    (train,) = re.findall(r"attnlab train --config (\S+) --workdir (\S+)\n", text)
    config = README.parent / train[0]
    experiment.validate(experiment.load_config(f"{config}:tiny"))
    workdir = tmp_path / "char_lm"
    shutil.copytree(tiny_lm_run, workdir)
    commands = [
        line.split("#")[0].strip()
        for line in text.splitlines()
        if line.startswith(("attnlab eval", "attnlab plot", "attnlab sample"))
        and "--pretrained" not in line  # needs a Hugging Face folder (tests/test_text_generation)
    ]
    assert [c.split()[1] for c in commands] == ["eval", "eval", "plot", "sample"]
    for command in commands:
        command = re.sub(r"\[[^\]]*\]", "", command).replace("DIR", str(workdir))
        capsys.readouterr()
        assert main(shlex.split(command)[1:]) == 0, command
        out = capsys.readouterr().out
        assert out.strip(), command
    assert out.startswith("def ")
    assert (workdir / "loss.png").read_bytes()[:4] == b"\x89PNG"
