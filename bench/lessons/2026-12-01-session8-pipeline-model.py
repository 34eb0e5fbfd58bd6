"""Random-interleaving model of the pipelined cluster-row backward (norm_bwd_staged_kernel,
CLUSTER): C blocks, each a sequential agent (its barriers make it one), R rows, S ring stages,
K inbox slots. Remote st.async deliveries and bulk copies complete after random delays.
Checks: every inbox read sees the values of the row it waits for, every stage read sees its
row, no mbarrier gets bytes of a later phase, and nothing deadlocks."""
import random
import sys


class Bar:
    def __init__(self):
        self.k = 0  # completed phases
        self.pending = 1
        self.tx = 0
        self.log = []

    def arrive_expect(self, n):
        self.tx += n
        self.pending -= 1
        self._check()

    def complete(self, n):
        self.tx -= n
        self._check()

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.k += 1
            self.pending = 1

    def passed(self, parity):
        return (self.k & 1) != parity


def run(C, R, S, K, seed):
    rng = random.Random(seed)
    inbox = [[[None] * C for _ in range(K)] for _ in range(C)]
    xbar = [[Bar() for _ in range(K)] for _ in range(C)]
    stage_row = [[None] * S for _ in range(C)]
    sbar = [[Bar() for _ in range(S)] for _ in range(C)]
    inflight = []  # (deliver function)

    def fill(b, s, row):
        sbar[b][s].arrive_expect(1)
        def land():
            stage_row[b][s] = row
            sbar[b][s].complete(1)
        inflight.append(land)

    def agent(b):
        for s in range(min(S, R)):
            fill(b, s, s)
        uses = [0] * K  # per-slot use count (the ExchangeCursor phase is uses & 1)
        i = 0
        while True:
            reduces = i < R
            if reduces:
                st, ph = i % S, (i // S) & 1
                while not sbar[b][st].passed(ph):
                    yield
                yield
                assert stage_row[b][st] == i, f"block {b} stage {st} holds {stage_row[b][st]}, wants {i}"
                yield  # the block barrier of the reduction
                if i - 2 >= 0 and i - 2 + S < R:
                    fill(b, (i - 2) % S, i - 2 + S)
                slot = i % K
                inbox[b][slot][b] = i
                xbar[b][slot].arrive_expect(C - 1)
                for to in range(C):
                    if to != b:
                        def deliver(to=to, slot=slot, row=i):
                            bar = xbar[to][slot]
                            # bytes of use row // K must not land in an earlier phase
                            assert bar.k == row // K, f"block {to} slot {slot} in phase {bar.k} gets row {row}"
                            inbox[to][slot][b] = row
                            bar.complete(1)
                        inflight.append(deliver)
                yield
            if i > 0:
                done = i - 1
                slot = done % K
                while not xbar[b][slot].passed((done // K) & 1):
                    yield
                yield
                assert all(v == done for v in inbox[b][slot]), f"block {b} row {done} inbox {inbox[b][slot]}"
                yield
                assert stage_row[b][done % S] == done, f"block {b} rereads stage of {done}: {stage_row[b][done % S]}"
                yield
            if not reduces:
                return
            i += 1

    agents = {b: agent(b) for b in range(C)}
    steps = 0
    while agents or inflight:
        steps += 1
        if steps > 10**6:
            raise RuntimeError("deadlock")
        if inflight and (not agents or rng.random() < 0.3):
            inflight.pop(rng.randrange(len(inflight)))()
            continue
        b = rng.choice(list(agents))
        try:
            next(agents[b])
        except StopIteration:
            del agents[b]


if __name__ == "__main__":
    K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    failures = 0
    for seed in range(3000):
        rng = random.Random(seed)
        C, R = rng.choice([2, 4, 8]), rng.randint(1, 40)
        try:
            run(C, R, S, K, seed)
        except (AssertionError, RuntimeError) as e:
            failures += 1
            if failures <= 3:
                print(f"seed {seed} C={C} R={R}: {e}")
    print(f"K={K} S={S}: {failures} failures in 3000 runs")
