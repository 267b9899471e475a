"""The mechanism probe (Table 2): the marked shift-copy task, the blur-rung attention the
probe's learned alphas train through, and the loop that trains and scores a probe run."""
