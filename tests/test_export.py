"""`vim-ds export`: a torch.export program of a real weights file that loads in a fresh process (import vim_ds,
torch.export.load) and gives the eager model's logits; bad input is one line and exit 2."""
import os
import subprocess
import sys

import pytest
import timm
import torch

import vim_ds  # noqa: F401
from vim_ds.cli.export import main

import preloaded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = ["--model", "vim_tiny", "--input-size", "32", "--model-kwargs", "depth=2", "embed_dim=32", "patch_size=16",
        "stride=8"]

LOAD_AND_RUN = """
import sys, torch
import vim_ds  # registers the vim_ds ops the program calls
program = torch.export.load(sys.argv[1])
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(program.module()(x), sys.argv[3])
"""


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A published-format file ({"model": state_dict}) of a small Vim, and the model itself."""
    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=16,
                              stride=8).eval()
    path = str(tmp_path_factory.mktemp("weights") / "vim.pth")
    torch.save({"model": model.state_dict()}, path)
    return path, model


def test_exported_program_gives_the_eager_logits_in_a_fresh_process(weights, tmp_path):
    path, model = weights
    out = str(tmp_path / "model.pt2")
    proc = preloaded.run([sys.executable, "-m", "vim_ds.export", "--weights", path, "--out", out, *ARCH],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    x = torch.randn(3, 3, 32, 32)  # a batch size other than the example's: the batch dimension is dynamic
    torch.save(x, tmp_path / "x.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, out, str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), want, rtol=1e-5, atol=1e-6)


def test_missing_weights_file_is_one_line(tmp_path, capsys):
    assert main(["--weights", str(tmp_path / "nope.pth"), "--out", str(tmp_path / "m.pt2"), *ARCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]


def test_mismatched_weights_are_one_line(weights, tmp_path, capsys):
    path, _ = weights
    arch = [a.replace("embed_dim=32", "embed_dim=48") for a in ARCH]
    assert main(["--weights", path, "--out", str(tmp_path / "m.pt2"), *arch]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vim-ds export: error:") and "shape mismatch" in err[0]
    assert not os.path.exists(tmp_path / "m.pt2")


def test_out_never_lands_on_the_weights_or_on_a_file_export_did_not_write(weights, tmp_path, capsys):
    """`--out` naming the --weights file wrote the program over the weights (the issue's `convert` case, in export);
    the variants: the weights under another name (a link), and a file that is not a program. Refused before the
    export, in one line; the files keep their bytes. The control: a program exported earlier is replaced."""
    import shutil

    from vim_ds.cli.export import out_problem

    path = tmp_path / "vim.pth"
    shutil.copy(weights[0], path)
    os.symlink(path, tmp_path / "link.pt2")
    (tmp_path / "notes.pt2").write_text("not a program")
    before = {name: (tmp_path / name).read_bytes() for name in ("vim.pth", "notes.pt2")}
    refused = {
        path: f"--out {path} is the --weights file {path}: writing the program would destroy the weights; give --out "
              f"a new name, e.g. model.pt2",
        tmp_path / "link.pt2": f"--out {tmp_path / 'link.pt2'} is the --weights file {path}: writing",
        tmp_path / "notes.pt2": f"--out {tmp_path / 'notes.pt2'} exists and is not a torch.export program: vim-ds "
                                f"export replaces only a program it wrote; give --out a new name, or move "
                                f"{tmp_path / 'notes.pt2'} away first"}
    for out, error in refused.items():
        assert main(["--weights", str(path), "--out", str(out), *ARCH]) == 2
        assert [line[len("vim-ds export: error: "):][:len(error)]
                for line in capsys.readouterr().err.strip().splitlines()] == [error]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before

    class Double(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    program = tmp_path / "earlier.pt2"
    torch.export.save(torch.export.export(Double(), (torch.ones(2),)), str(program))
    assert out_problem(str(program), str(path)) is None
