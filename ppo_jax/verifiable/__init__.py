"""RL with a verifiable reward: sorting number words, checked exactly (`task`), SFT on imperfect
demonstrations then RL on the 1/0 reward with held-out exact-match accuracy (`pipeline`)."""
