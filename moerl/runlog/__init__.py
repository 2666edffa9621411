"""What a run shows its user: the run log (metrics.jsonl, trajectories.jsonl, expert load, TensorBoard), the
progress line on the terminal, and the plots written at the end (reward, throughput, expert load). Nothing here
feeds back into training.
"""
