"""Acyclicity-safe coarsening of the operator graph into blocks (FTPipe §4.1 step 1).

A `Coarse` graph is a quotient of the node DAG whose groups are kept in a topological
order. Merging groups x before y is refused when another path leads from x to y (the
merged group would sit on a cycle); when it is safe, the groups that x reaches before y
move behind the merged group, which keeps the order topological without a global re-sort
(a local version of the dynamic topological sort the paper uses).

    c = Coarse(costs); c.merge(a, b) -> bool
    atoms(costs)                      zero-cost nodes and heavy outputs folded into neighbours
    by_scope(c, key); grow_centers(c, L, fits)
"""

from __future__ import annotations

from .indexed import NodeCosts, lowest_first


class Coarse:
    def __init__(self, costs: NodeCosts, groups: list[list[int]] | None = None):
        self.c = costs
        groups = groups if groups is not None else [[i] for i in range(costs.n)]
        where = {}
        for k, nodes in enumerate(groups):
            for i in nodes:
                where[i] = k
        self.members = {k: sorted(nodes) for k, nodes in enumerate(groups)}
        self.work = {k: sum(costs.rec[i] for i in nodes) for k, nodes in enumerate(groups)}
        self.succ = {k: set() for k in self.members}
        self.pred = {k: set() for k in self.members}
        for i in range(costs.n):
            for j in costs.succs[i]:
                a, b = where[i], where[j]
                if a != b:
                    self.succ[a].add(b)
                    self.pred[b].add(a)
        self.order = _topological(self.members, self.succ)
        self.pos = {g: k for k, g in enumerate(self.order)}

    def copy(self) -> Coarse:
        new = object.__new__(Coarse)
        new.c = self.c
        new.members = {k: list(v) for k, v in self.members.items()}
        new.work = dict(self.work)
        new.succ = {k: set(v) for k, v in self.succ.items()}
        new.pred = {k: set(v) for k, v in self.pred.items()}
        new.order, new.pos = list(self.order), dict(self.pos)
        return new

    def live(self) -> list[int]:
        """Group ids in topological order."""
        return [g for g in self.order if g is not None]

    def groups(self) -> list[list[int]]:
        return [self.members[g] for g in self.live()]

    def neighbours(self, g: int) -> set[int]:
        return self.succ[g] | self.pred[g]

    def merge(self, a: int, b: int) -> int | None:
        """Merge two groups; returns the surviving id, or None when that would close a cycle."""
        if a == b:
            return a
        x, y = (a, b) if self.pos[a] < self.pos[b] else (b, a)
        px, py = self.pos[x], self.pos[y]
        reach, stack = set(), [s for s in self.succ[x] if s != y]
        while stack:
            s = stack.pop()
            if s == y:
                return None
            if s in reach or self.pos[s] > py:
                continue
            reach.add(s)
            stack.extend(self.succ[s])
        # Order x..y as: groups x does not reach, the merged group, groups x reaches; the
        # freed slot stays as a hole (None) so no position outside x..y changes.
        mid = [g for g in self.order[px + 1 : py] if g is not None]
        new = [g for g in mid if g not in reach] + [x] + [g for g in mid if g in reach]
        self.order[px : py + 1] = [None] * (py + 1 - px - len(new)) + new
        for k in range(px, py + 1):
            if self.order[k] is not None:
                self.pos[self.order[k]] = k
        self.members[x].extend(self.members.pop(y))
        self.work[x] += self.work.pop(y)
        for s in self.succ.pop(y):
            self.pred[s].discard(y)
            if s != x:
                self.pred[s].add(x)
                self.succ[x].add(s)
        for p in self.pred.pop(y):
            self.succ[p].discard(y)
            if p != x:
                self.succ[p].add(x)
                self.pred[x].add(p)
        self.succ[x].discard(x)
        self.pred[x].discard(x)
        del self.pos[y]
        return x


def _topological(members, succ) -> list[int]:
    """Groups in topological order, the one with the smallest first node index first, so
    the order follows the graph's."""
    out = lowest_first({g: succ[g] for g in members}, lambda g: min(members[g]))
    if out is None:
        raise ValueError("the groups given to Coarse form a cycle")
    return out


def atoms(costs: NodeCosts, heavy_percentile: float = 99.0) -> Coarse:
    """Fold nodes that are poor stage borders into a neighbour: they become indivisible atoms.

    Zero-cost nodes (views, shape ops) go to their lightest neighbour; a node whose output is
    among the largest (above the percentile) joins its consumers, so no cut ever sends it.
    Atoms stay small (a fraction of a GPU's share) so refinement keeps fine control.
    """
    c = Coarse(costs)
    cap = max(max(costs.rec, default=0.0), sum(costs.rec) / (8 * max(costs.problem.gpus, 1)))
    where = list(range(costs.n))

    def find(i: int) -> int:
        while where[i] != i:
            where[i] = where[where[i]]
            i = where[i]
        return i

    def join(i: int, g: int) -> bool:
        gi = find(i)
        if gi == g or c.work[gi] + c.work[g] > cap:
            return False
        kept = c.merge(gi, g)
        if kept is None:
            return False
        where[gi if kept == g else g] = kept
        return True

    for i in range(costs.n):
        if costs.rec[i] == 0.0:
            gi = find(i)
            for g in sorted(c.neighbours(gi), key=lambda g: (c.work[g], c.pos[g])):
                if join(i, g):
                    break
    ranked = sorted(costs.out)
    if ranked:
        cut = ranked[min(len(ranked) - 1, int(len(ranked) * heavy_percentile / 100.0))]
        for i in range(costs.n):
            if costs.out[i] >= cut > 0:
                for j in costs.succs[i]:
                    join(j, find(i))
    return c


def by_scope(c: Coarse, key) -> Coarse:
    """Merge the groups whose heaviest node shares a scope key (e.g. one `T5Block`)."""
    costs = c.c
    scopes = costs.problem.graph.nodes
    first: dict[str, int] = {}
    for g in c.live():
        if g not in c.members:
            continue
        heaviest = max(c.members[g], key=lambda i: (costs.rec[i], -i))
        k = key(scopes[heaviest].scope)
        if k in first and first[k] in c.members:
            kept = c.merge(first[k], g)
            if kept is not None:
                first[k] = kept
                continue
        first[k] = g
    return c


def grow_centers(c: Coarse, blocks: int, fits, offset: float = 0.5) -> Coarse:
    """Grow `blocks` centres, spread evenly by work, by absorbing neighbours, lightest first.

    The lightest centre takes its lightest non-centre neighbour (a balanced form of the
    paper's round-robin), if the merge is safe and `fits(centre's nodes, neighbour's)` holds
    for the two together, until no non-centre group is left or none can be absorbed. A
    centre's node list only grows at its end while it stays one (`Coarse.merge` extends the
    earlier group's), so `fits` may keep what it counted of it.
    """
    total = sum(c.work.values()) or 1.0
    centres: list[int] = []
    acc = 0.0
    want = [(k + offset) * total / blocks for k in range(blocks)]
    for g in c.live():
        acc += c.work[g]
        while want and acc >= want[0]:
            want.pop(0)
            if g not in centres:
                centres.append(g)
    cset = set(centres)
    stuck: set[int] = set()
    while len(c.members) > len(cset) and len(stuck) < len(cset):
        ctr = min((g for g in cset if g not in stuck), key=lambda g: (c.work[g], c.pos[g]))
        for nb in sorted(
            (g for g in c.neighbours(ctr) if g not in cset), key=lambda g: (c.work[g], c.pos[g])
        ):
            if fits(c.members[ctr], c.members[nb]):
                kept = c.merge(ctr, nb)
                if kept is not None:
                    if kept != ctr:
                        cset.discard(ctr)
                        cset.add(kept)
                    stuck.clear()
                    break
        else:
            stuck.add(ctr)
    return c
