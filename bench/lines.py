"""Lines of each zoo pipeline's algorithm file (its three functions and their wiring) against
the official counterparts and the original Redco examples, as the paper's Figure 4 compares
them. Counts every physical line of this repository's files, docstrings included; the reference
counts are not recounted here: they are the paper's Figure 4 comparison as transcribed in the
project's design brief (``SOURCE``), and the table says so.

Run:  python bench/lines.py
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINES = {  # zoo file, official counterpart (lines), original Redco example (lines)
    "lm": ("zoo/lm/redco_zoo_lm/pipeline.py", "HF run_clm_flax.py", 869, 129),
    "seq2seq": ("zoo/seq2seq/redco_zoo_seq2seq/pipeline.py", "HF run_summarization_flax.py",
                1020, 196),
    "captioning": ("zoo/captioning/redco_zoo_captioning/pipeline.py",
                   "HF run_image_captioning_flax.py", 1283, 206),
    "maml": ("zoo/maml/redco_zoo_maml/pipeline.py", "cbfinn/maml", 820, 198),
    "ppo": ("zoo/ppo/redco_zoo_ppo/pipeline.py", "CleanRL ppo.py", 312, 315),
    "fedavg": ("zoo/fedavg/redco_zoo_fedavg/pipeline.py", "fedjax fed_avg + driver", 205, 353),
}


SOURCE = ("reference counts (official, original Redco): the RedCoast paper's Figure 4 comparison "
          "(arXiv:2310.16355) as transcribed in the project's design brief; not recounted here")


def main() -> None:
    print("| pipeline | this zoo (counted) | official | lines* | ratio | original Redco* | ratio |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, (path, official, official_lines, redco_lines) in PIPELINES.items():
        with open(os.path.join(ROOT, path)) as f:
            ours = len(f.readlines())
        print(f"| {name} | {ours} | {official} | {official_lines} | {ours / official_lines:.2f} | "
              f"{redco_lines} | {ours / redco_lines:.2f} |")
    templates = {name: path.rsplit("/", 1)[0] + "/template/main.py"
                 for name, (path, *_) in PIPELINES.items()}
    counts = []
    for name, path in templates.items():
        with open(os.path.join(ROOT, path)) as f:
            counts.append(f"{len(f.readlines())} ({name})")
    print(f"\n\\* {SOURCE}\n\ntemplates' main.py: {', '.join(counts)} lines")


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
