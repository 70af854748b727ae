"""The laptop tooling's progress lines: one prefix, on stderr."""
from tpuft_local import console


def test_say_writes_one_prefixed_line_to_stderr(capsys):
    console.say("cluster up in 3 s")
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "[tpuft] cluster up in 3 s\n")
