"""The contract the compiler, the generated packages and the runtime share: the plan as data
(`topology`: the plan as one rank sees it, with its checks), the names and initial values of
weights (`weights`). Plain data and pure functions: no process groups, no side effects."""
