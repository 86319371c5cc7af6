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


# ---------------------------------------------------------------- verbs from entry points

_PLUGIN = '''
def register(sub):
    p = sub.add_parser("hello", help="say hello")
    p.add_argument("--name", default="world")
    p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)
'''


def _run_cli(tmp_path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that can import the plugin module ``aospec_hello``."""
    (tmp_path / "aospec_hello.py").write_text(_PLUGIN)
    prelude = (
        "import sys; from importlib.metadata import EntryPoint; from aospec.cli import main;"
        f"sys.path.insert(0, {str(tmp_path)!r});"
        "ep = lambda name, value: EntryPoint(name=name, value=value, group='aospec.commands');"
    )
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)


def test_the_installed_verbs_come_from_entry_points_of_their_packages():
    from aospec.cli import command_entry_points

    verbs = {ep.name: ep.value for ep in command_entry_points()}
    assert verbs == {
        "drafters": "aospec.replay.cli.drafters:register",
        "mcp": "aospec.integrations.mcp_server:register",
        "models": "aospec.training.cli:register_models",
        "proxy": "aospec.integrations.proxy:register",
        "replay": "aospec.replay.cli.sweep:register_replay",
        "routers": "aospec.specbox.cli:register",
        "run": "aospec.live.cli:register",
        "sandbox": "aospec.runtime.cli:register",
        "serve-trace": "aospec.live.serve_trace:register",
        "sweep": "aospec.replay.cli.sweep:register_sweep",
        "traces": "aospec.replay.cli.traces:register",
        "train": "aospec.training.cli:register",
    }


def test_every_installed_verb_loads_and_shows_help():
    proc = subprocess.run([sys.executable, "-m", "aospec", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr
    for verb in (
        "drafters", "mcp", "proxy", "replay", "routers", "run", "sandbox", "serve-trace", "sweep", "traces", "train"
    ):
        assert verb in proc.stdout


def test_a_third_party_entry_point_adds_a_verb(tmp_path):
    proc = _run_cli(tmp_path, "sys.exit(main(['hello', '--name', 'you'], commands=[ep('hello', 'aospec_hello:register')]))")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "hello you\n", "")
    proc = _run_cli(tmp_path, "sys.exit(main(['--help'], commands=[ep('hello', 'aospec_hello:register')]))")
    assert proc.returncode == 0 and "hello     say hello" in proc.stdout


def test_a_verb_that_cannot_be_loaded_is_one_error_naming_it(tmp_path):
    commands = "[ep('hello', 'aospec_hello:register'), ep('broken', 'aospec_no_such_module:register')]"
    proc = _run_cli(tmp_path, f"sys.exit(main(['broken'], commands={commands}))")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "aospec: error: command 'broken' could not be loaded (aospec_no_such_module:register): "
        "ModuleNotFoundError: No module named 'aospec_no_such_module'"
    ]
    # The other verbs still work, and help lists them, warning about the broken one.
    proc = _run_cli(tmp_path, f"sys.exit(main(['hello'], commands={commands}))")
    assert (proc.returncode, proc.stdout) == (3, "hello world\n")
    proc = _run_cli(tmp_path, f"sys.exit(main(['--help'], commands={commands}))")
    assert proc.returncode == 0 and "hello" in proc.stdout and "broken" not in proc.stdout
    assert "aospec: warning: command 'broken' could not be loaded" in proc.stderr


def test_running_a_verb_loads_only_that_verbs_package():
    probe = (
        "import sys\nfrom aospec.cli import main\ntry:\n    main(['traces', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'training', 'runtime'}), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.stdout.startswith("usage: aospec traces")
    assert "LOADED []" in proc.stderr
