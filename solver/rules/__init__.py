"""Rules that build schedules without a MILP, each judged by the simulator: the kept set and its
recomputation policy with Chen's segments, greedy and ranked dropping (simple.py), segments at
narrow cuts and per named block (segments.py), repeated blocks (blocks.py) and their chain
combination (chain.py), and the first incumbents they offer the search (warmstart.py).

Below the search (solver/search/), above the IR, the simulator and the formulation."""
