"""Planning: Algorithm 1 (window size, active/frozen sets), the run-time window planner, expert popularity, and
the placement of peer copies (Algorithm 2)."""
