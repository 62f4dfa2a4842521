"""Prompt streams: datasets, record formats, procedural tasks and prompt construction.

- datasets.py            local JSONL / JSON / Parquet files -> problems -> a grain stream
- formats.py             built-in record formats (gsm8k, math, ...) -> `Problem`
- prompts.py             a problem's question -> the text the sampler continues
- tasks.py               procedural tasks with verifiable rewards, for tiny models
- reasoning_gym_task.py  any reasoning-gym dataset as a text task
- word_problems.py       GSM8K-format word problems from a seeded generator
- word_problem_kinds.py  the kinds of word problem, each a function of a draw
- word_problem_draw.py   the vocabulary every word problem is drawn from
"""
