"""The examples under every `monetlike COMMAND --help` (an argparse epilog), in one place;
tests/test_cli_help.py parses each with today's flags."""

from __future__ import annotations

import argparse

EXAMPLES = {
    "": ["monetlike explain resnet18 --batch 32 --input-shape 3,64,64",
         "monetlike solve resnet18 --batch 32 --input-shape 3,64,64 --budget 160MiB -o s.json",
         "monetlike COMMAND --help   (examples for each command)"],
    "profile": ["monetlike profile resnet18 --batch 32 --input-shape 3,64,64 -o graph.json",
                "monetlike profile gpt2 --batch 8 --cost analytical:A100-40GB -o graph.json"],
    "solve": ["monetlike solve resnet18 --batch 32 --input-shape 3,64,64 --budget 160MiB -o s.json",
              "monetlike solve resnet50 --batch 184 --budget 8GiB --cost analytical:A100-40GB "
              "--time-limit 120 -o s.json"],
    "backends": ["monetlike backends"],
    "check": ["monetlike check s.json --model resnet18"],
    "zoo": ["monetlike zoo list", "monetlike zoo show resnet50_184_8GiB",
            "monetlike zoo pick --model resnet50 --batch 184 --budget 8GiB -o s.json"],
    "explain": ["monetlike explain torchvision.models.resnet50 --batch 184 --optimizer sgd "
                "--plot memory.png"],
    "pareto": ["monetlike pareto resnet50 --batch 184 --budgets 5GiB,6GiB,8GiB,10GiB "
               "--plot pareto.png"],
    "maxbatch": ["monetlike maxbatch resnet50 --budget 8GiB --max-overhead 10%",
                 "monetlike maxbatch gpt2 --budget 12GiB --input-shape 1024"],
}


def add_examples(parser: argparse.ArgumentParser, sub) -> None:
    """An 'examples:' epilog under every command's --help, kept as written."""
    for name, p in [("", parser), *sub.choices.items()]:
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
