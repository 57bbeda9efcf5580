"""The rendezvous port: below the kernel's ephemeral range, where no outgoing connection can take it
between the pick and rank 0's listen (a CI run lost one that way: EADDRINUSE, 2026-11-27)."""
import socket

from megatron_dualpipe.launch import ports


def test_ports_are_picked_below_the_ephemeral_range_and_free():
    start = ports._ephemeral_start()
    picked = [ports.free_port() for _ in range(50)]
    print(f"\nephemeral range starts at {start}; picked {sorted(picked)[:5]} ... {sorted(picked)[-5:]}")
    assert all(ports.LOWEST <= p < start for p in picked)
    assert len(set(picked)) > 40  # spread, so that two jobs starting together rarely pick the same
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[0]))  # still free


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # the held port first, then its neighbours (on a busy machine some of them are in use too:
        # a CI run found taken + 1 taken, 2026-11-27)
        others = [p for p in range(taken - 50, taken + 50) if 1024 <= p < 65536 and p != taken]
        choices = iter([taken, *others])
        monkeypatch.setattr(ports, "LOWEST", 1024)
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(choices))
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        port = ports.free_port()
        print(f"\nheld {taken}, picked {port}")
        assert port != taken and port in others
