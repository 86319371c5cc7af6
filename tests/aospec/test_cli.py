import subprocess
import sys

from aospec import __version__
from aospec.cli import build_parser, main


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices, "no subcommands registered"
    for name in sub.choices:
        try:
            main([name, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith("usage: aospec " + name), name


def test_version_flag():
    proc = subprocess.run([sys.executable, "-m", "aospec", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"aospec {__version__}"


def test_help_does_not_import_heavy_packages():
    code = (
        "import sys; from aospec.cli import build_parser; build_parser();"
        "heavy = [m for m in ('torch', 'transformers', 'docker', 'vllm', 'openai', 'matplotlib') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == ""
