#!/usr/bin/env python3
"""The doc test: README.md and docs/*.md name only what exists, and their runnable blocks run.

    check_docs.py --build BUILD_DIR [--repo REPO] [--conforming FILE]... [--no-run] [FILE...]

Reads FILE... (default: README.md and docs/*.md of REPO) and prints each problem as FILE:LINE:
  path      a repository path (src/, include/, tests/, tools/, examples/, bench/, scripts/, docs/,
            cmake/, .ci/, a header lockstep/...h, a top-level file), in prose, in `code` or in a
            code block, that does not exist. A name without an extension may be a program whose
            source has one (examples/train_gpt); build/<dir>/{tools,examples,bench}/NAME must have
            a source there. Skipped: paths with a placeholder (<layer>, ..., *, $VAR) and GENERATED.
  link      a relative link or #anchor that leads to no file or heading.
  flag      a flag that the program's --help does not list. A flag belongs to the program before
            it in the same command (a code block's line, with its \\ continuations, or a `span`):
            lockstep run, lockstep plot, lockstep checkpoint consolidate, train_fashion_mnist,
            train_gpt, and make demo/train/gpt-data's ARGS. `lockstep run`'s flags end at its
            PROGRAM; the flags of any other program (cmake, srun, torchrun, python...) are not
            checked. A `span` that starts with a flag (`--zero 1`, a table's `-o, --output`)
            names no program: its flags must belong to one of them, or to FOREIGN_FLAGS.
  sentence  a prose sentence (not code, tables or headings) of more than MAX_WORDS words, in
            README.md, docs/*.md or a file given with --conforming; other files' counts are
            printed as a warning.
  run       a fenced or indented code block after a line `<!-- doc-test: run -->` that exits
            non-zero or takes over RUN_TIMEOUT seconds. It runs under bash -e -o pipefail in a
            scratch directory that links the repository's directories and files above and has
            build/release pointing at BUILD_DIR, so what it writes (run/ckpt.safetensors) goes
            away with it. `<!-- doc-test: run, with PROGRAM ARGS... -->` (several joined by ;)
            appends ARGS to each command of PROGRAM: small settings for a long job.
Exit status: 0 no problem, 1 problems (listed), 2 bad usage.
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

# Every prose sentence of README.md and docs/*.md has at most MAX_WORDS words: a longer one fails
# the test. Other files' long sentences are counted and printed as a warning.
MAX_WORDS = 40

# Seconds a runnable block may take.
RUN_TIMEOUT = 120

# Paths the docs name that no checkout holds, because a command writes them.
GENERATED = [
    "bench/results/",  # make bench (scripts/run-bench.sh)
]

# Flags that prose names alone (`--flag` with no program before it) and that belong to programs
# whose flags are not checked. The flags of the checked programs need no entry.
FOREIGN_FLAGS = {
    "--ntasks-per-node", "--requeue", "--signal",  # SLURM's srun and sbatch
    "--compile", "--save-init",  # bench/pytorch_gpt.py
    "--only", "--rounds", "--no-model-check",  # bench/gpt_compare.py, bench/allreduce and others
    "--procs", "--max-bytes", "--slot-bytes",  # bench/allreduce
}

# The programs whose flags are checked, by the name that a command calls them by: their binary in
# the build directory. `lockstep`'s subcommands (run, plot, checkpoint consolidate) come from its
# --help.
PROGRAMS = {
    "lockstep": "tools/lockstep",
    "train_fashion_mnist": "examples/train_fashion_mnist",
    "train_gpt": "examples/train_gpt",
}
# `make TARGET ARGS="..."` hands ARGS to a program (the Makefile).
MAKE_ARGS = {"demo": "train_fashion_mnist", "train": "train_fashion_mnist",
             "gpt-data": "train_gpt"}

REPO_DIRS = ("src", "include", "tests", "tools", "examples", "bench", "scripts", "docs", "cmake",
             ".ci")
TOP_FILES = ("Makefile", "CMakeLists.txt", "CMakePresets.json", "README.md")
# Fenced blocks in these languages hold no shell commands.
NOT_SHELL = {"cpp", "c++", "c", "cc", "h", "python", "py", "json", "jsonl", "cmake"}

RUN_MARKER = re.compile(r"<!--\s*doc-test:\s*run\b(.*?)-->")
PLACEHOLDER = re.compile(r"[<>*?$\[\]{}|]|\.\.\.|…")
NOT_BEFORE_PATH = r"(?<![\w./~@:+-])"
PATH_RE = re.compile(NOT_BEFORE_PATH + r"(?:\./)?((?:%s)/[^\s`'\"(),;:]*)"
                     % "|".join(re.escape(d) for d in REPO_DIRS))
HEADER_RE = re.compile(NOT_BEFORE_PATH + r"(lockstep/[\w/.-]+\.h)\b")
TOP_RE = re.compile(NOT_BEFORE_PATH + r"(%s)(?![\w.-])"
                    % "|".join(re.escape(f) for f in TOP_FILES))
BUILD_PROGRAM_RE = re.compile(NOT_BEFORE_PATH + r"(?:\./)?build/[\w.-]+/(tools|examples|bench)/"
                              r"([\w-]+)(?![\w./-])")
LINK_RE = re.compile(r"\]\(([^()\s]+)\)")
FLAG_RE = re.compile(r"^(--[A-Za-z0-9][\w-]*|-[A-Za-z])(=.*)?$")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, kind, message):
        self.items.append((where, kind, message))


# ---------------------------------------------------------------------------------------------
# Reading a Markdown file

class Block:
    """A code block: lines of (number, text), its language, the runnable marker before it."""

    def __init__(self, start, lang, marker):
        self.start, self.lang, self.marker, self.lines = start, lang, marker, []


def parse(text):
    """Splits a Markdown file into code blocks and prose lines (number, text, kind)."""
    blocks, prose, markers = [], [], []
    lines = text.split("\n")
    fence = None
    block = None
    pending_marker = None  # (line, options) of a run marker awaiting its block
    prev_blank = True
    in_list = False  # the paragraph before the blank line was a list item: 4 spaces continue it
    for n, line in enumerate(lines, 1):
        if fence is not None:
            if re.match(r"^\s*" + re.escape(fence) + r"\s*$", line):
                fence = None
                blocks.append(block)
                block = None
            else:
                block.lines.append((n, line))
            continue
        m = FENCE.match(line)
        if m:
            fence = m.group(2)
            block = Block(n, m.group(3).lower(), pending_marker)
            pending_marker = None
            prev_blank = False
            continue
        expanded = line.expandtabs(4)
        if block is not None:  # an indented block goes on while lines are indented or blank
            if expanded.startswith("    ") or not line.strip():
                block.lines.append((n, expanded[4:] if expanded.startswith("    ") else ""))
                continue
            while block.lines and not block.lines[-1][1].strip():
                block.lines.pop()
            blocks.append(block)
            block = None
            prev_blank = True
        if expanded.startswith("    ") and line.strip() and prev_blank and not in_list:
            block = Block(n, "", pending_marker)
            pending_marker = None
            block.lines.append((n, expanded[4:]))
            continue
        if not line.strip():
            prev_blank = True
            continue
        marker = RUN_MARKER.search(line)
        if marker:
            if pending_marker:
                markers.append(pending_marker)
            pending_marker = (n, marker.group(1))
            prev_blank = True  # an HTML block ends at its line: a code block may follow
            continue
        if pending_marker:
            markers.append(pending_marker)  # a marker with no code block after it
            pending_marker = None
        if prev_blank:
            in_list = bool(LIST_ITEM.match(line))
        elif LIST_ITEM.match(line):
            in_list = True
        prev_blank = False
        stripped = line.strip()
        if stripped.startswith("#"):
            kind = "heading"
        elif stripped.startswith("|"):
            kind = "table"
        elif stripped.startswith("<!--") or stripped.startswith("<"):
            kind = "html"
        else:
            kind = "text"
        prose.append((n, line, kind))
    if block is not None:
        blocks.append(block)
    if pending_marker:
        markers.append(pending_marker)
    return blocks, prose, markers


def code_spans(line):
    return re.findall(r"`+([^`]+)`+", line)


def logical_lines(block):
    """A block's commands: lines joined where they end with a backslash, with their first line."""
    out, cur, start = [], "", None
    for n, line in block.lines:
        if start is None:
            start = n
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append((start, cur + line))
        cur, start = "", None
    if start is not None:
        out.append((start, cur))
    return out


def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lstrip("#").strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    blocks, prose, _ = parse(text)
    for _, line, kind in prose:
        if kind == "heading":
            s = slug(line)
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else "%s-%d" % (s, k))
    return out


# ---------------------------------------------------------------------------------------------
# Programs and their flags

class Program:
    def __init__(self, name, options, subcommands):
        self.name = name
        self.options = options  # flag -> takes a value
        self.subcommands = subcommands


def parse_help(text):
    """(options: flag -> takes a value, subcommands) from a CLI11 --help."""
    options, subcommands, section = {}, [], None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line[:-1]
            continue
        m = re.match(r"^  (-\S+)(.*)", line)
        if m:
            takes_value = bool(re.match(r"\s+[A-Z]{2,}", m.group(2)))
            for flag in re.sub(r"\{[^}]*\}", "", m.group(1)).split(","):
                options[flag] = takes_value
        elif section == "Subcommands":
            m = re.match(r"^  ([\w-]+)\s", line)
            if m:
                subcommands.append(m.group(1))
    return options, subcommands


def read_help(build, problems):
    """name ("lockstep run", "train_gpt") -> Program, from each program's --help (each level of
    subcommands at once: a start costs half a second on a busy machine)."""
    programs = {}
    level = []
    for name, binary in PROGRAMS.items():
        path = os.path.join(build, binary)
        if not os.access(path, os.X_OK):
            problems.add(build, "flag", "%s is missing: build it to check %s's flags"
                         % (path, name))
        else:
            level.append((name, [path]))

    def help_of(argv):
        try:
            return subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        while level:
            outs = list(pool.map(help_of, [argv for _, argv in level]))
            next_level = []
            for (name, argv), out in zip(level, outs):
                if isinstance(out, Exception) or out.returncode != 0:
                    problems.add(build, "flag", "%s --help failed: %s" % (
                        name, out if isinstance(out, Exception) else "exit %d" % out.returncode))
                    continue
                options, subcommands = parse_help(out.stdout)
                programs[name] = Program(name, options, subcommands)
                next_level += [(name + " " + sub, argv + [sub]) for sub in subcommands]
            level = next_level
    return programs


def program_of(token, programs):
    if token.startswith("-"):
        return None
    base = token.rstrip("/").split("/")[-1]
    return base if base in programs and base in PROGRAMS else None


def tokens_of(text):
    text = re.sub(r"(?:^|(?<=\s))#.*$", "", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: a fragment of a command
        tokens = text.split()
    return [t.strip("[],") if t.startswith("[") or t.endswith((",", "]")) else t for t in tokens]


def check_command(text, where, programs, problems):
    """Checks the flags of every checked program in a command line."""
    tokens = tokens_of(text)
    prog = None       # the Program whose flags follow
    launcher = False  # prog is `lockstep run`: its first positional is the PROGRAM
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if re.fullmatch(r"[();<>|&]+", tok):
            prog, launcher = None, False
            continue
        if " " in tok.strip():  # a quoted command: bash -c '...'
            check_command(tok, where, programs, problems)
        if tok == "make" and i < len(tokens) and tokens[i] in MAKE_ARGS:
            target = MAKE_ARGS[tokens[i]]
            for arg in tokens[i + 1:]:
                if re.fullmatch(r"[();<>|&]+", arg):
                    break
                if arg.startswith("ARGS="):
                    check_command(target + " " + arg[5:], where, programs, problems)
            prog, launcher = None, False
            continue
        name = program_of(tok, programs)
        # A program's name right after another program's flag is that flag's value
        # (python3 bench/gpt_losses.py --train-gpt build/release/examples/train_gpt).
        if name and not launcher and i >= 2 and FLAG_RE.match(tokens[i - 2]) \
                and "=" not in tokens[i - 2]:
            name = None
        if name:
            while i < len(tokens) and name + " " + tokens[i] in programs:
                name += " " + tokens[i]
                i += 1
            program = programs[name]
            prog, launcher = program, name == "lockstep run"
            if program.subcommands and i < len(tokens) and not FLAG_RE.match(tokens[i]):
                # `lockstep WORD`: a subcommand it lacks, or output ("lockstep run: ...").
                if re.fullmatch(r"[a-z][\w-]*", tokens[i]):
                    problems.add(where, "flag", "`%s` has no subcommand %s (its --help lists %s)"
                                 % (name, tokens[i], ", ".join(program.subcommands)))
                prog = None
            continue
        if prog is None:
            continue
        if tok == "--":
            if launcher:
                name = program_of(tokens[i], programs) if i < len(tokens) else None
                prog, launcher = (programs[name] if name else None), False
                i += 1
            continue
        m = FLAG_RE.match(tok)
        if m:
            flag = m.group(1)
            if flag not in prog.options:
                problems.add(where, "flag", "%s is not a flag of `%s` (not in its --help)"
                             % (flag, prog.name))
            elif prog.options[flag] and m.group(2) is None:
                i += 1  # its value
            continue
        if launcher:  # the PROGRAM that `lockstep run` starts
            name = program_of(tok, programs)
            prog, launcher = (programs[name] if name else None), False


def check_lone_flags(span, where, programs, problems):
    """A `span` that starts with a flag: each flag must belong to some checked program."""
    known = set(FOREIGN_FLAGS)
    for p in programs.values():
        known.update(p.options)
    for flag in re.findall(r"(?:^|[\s,(])(--?[A-Za-z][\w-]*)", span):
        if flag not in known:
            problems.add(where, "flag", "%s is a flag of none of %s (add it to FOREIGN_FLAGS if "
                         "another program's)" % (flag, ", ".join(sorted(PROGRAMS))))


# ---------------------------------------------------------------------------------------------
# Paths and links

def path_exists(repo, path):
    path = path.split("#")[0].rstrip(".")
    full = os.path.join(repo, path)
    if path.endswith("/"):
        return os.path.isdir(full)
    if os.path.exists(full):
        return True
    last = os.path.basename(path)
    return "." not in last and bool(glob.glob(glob.escape(full) + ".*"))


def check_paths(text, where, repo, problems):
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".")
        if PLACEHOLDER.search(path) or path.startswith(tuple(GENERATED)):
            continue
        if not path_exists(repo, path):
            problems.add(where, "path", "%s does not exist" % path)
    for m in HEADER_RE.finditer(text):
        if not os.path.exists(os.path.join(repo, "include", m.group(1))):
            problems.add(where, "path", "header %s does not exist (include/%s)"
                         % (m.group(1), m.group(1)))
    for m in TOP_RE.finditer(text):
        if not os.path.exists(os.path.join(repo, m.group(1))):
            problems.add(where, "path", "%s does not exist" % m.group(1))
    for m in BUILD_PROGRAM_RE.finditer(text):
        kind, name = m.group(1), m.group(2)
        if not (os.path.isdir(os.path.join(repo, kind, name))
                or glob.glob(os.path.join(repo, kind, glob.escape(name) + ".*"))):
            problems.add(where, "path", "%s: no program %s has its source in %s/"
                         % (m.group(0), name, kind))


def check_links(line, where, doc, repo, problems, anchor_cache):
    for m in LINK_RE.finditer(line):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        if file_part:
            path = os.path.normpath(os.path.join(os.path.dirname(doc), file_part))
            if not os.path.exists(os.path.join(repo, path)):
                problems.add(where, "link", "%s leads to no file (%s)" % (target, path))
                continue
        else:
            path = doc
        if anchor and path.endswith(".md"):
            if path not in anchor_cache:
                with open(os.path.join(repo, path), encoding="utf-8") as f:
                    anchor_cache[path] = anchors(f.read())
            if anchor not in anchor_cache[path]:
                problems.add(where, "link", "#%s is no heading of %s" % (anchor, path))


# ---------------------------------------------------------------------------------------------
# Sentences

def long_sentences(prose):
    """(line, words) of each prose sentence over MAX_WORDS words."""
    paragraphs, cur = [], []
    last = None
    for n, line, kind in prose:
        if kind != "text" or last is None or n != last + 1 or LIST_ITEM.match(line):
            if cur:
                paragraphs.append(cur)
            cur = []
        if kind == "text":
            cur.append((n, line))
        last = n
    if cur:
        paragraphs.append(cur)
    out = []
    for para in paragraphs:
        text, starts = "", []
        for n, line in para:
            starts.append((len(text), n))
            text += re.sub(r"^\s*(?:[-*+]|\d+[.)])\s+", "", line).strip() + " "
        text = re.sub(r"\]\([^)]*\)", "]", text)
        pos = 0
        for m in re.finditer(r"[.!?][\"')\]*`]*(?:\s+|$)", text + " "):
            sentence = text[pos:m.end()]
            words = len(re.findall(r"\S+", sentence))
            if words > MAX_WORDS:
                first = pos + len(sentence) - len(sentence.lstrip())
                out.append(([n for off, n in starts if off <= first][-1], words))
            pos = m.end()
        rest = text[pos:]
        if len(rest.split()) > MAX_WORDS:
            out.append(([n for off, n in starts if off <= pos][-1], len(rest.split())))
    return out


# ---------------------------------------------------------------------------------------------
# Runnable blocks

def with_settings(block, options, where, programs, problems):
    """The block's script, with the marker's `with PROGRAM ARGS` appended to PROGRAM's commands."""
    extra = []
    options = options.strip()
    if options:
        if not options.startswith(","):
            problems.add(where, "run", "the marker's words after `run` must be `, with PROGRAM "
                         "ARGS...`, not %r" % options)
            return None
        for part in options[1:].split(";"):
            words = part.split()
            if len(words) < 2 or words[0] != "with":
                problems.add(where, "run", "expected `with PROGRAM ARGS...`, not %r" % part.strip())
                return None
            extra.append((words[1], " ".join(words[2:])))
            check_command(" ".join(words[1:]), where, programs, problems)
    script = []
    for _, command in logical_lines(block):
        for program, args in extra:
            if re.search(r"(?:^|[\s/])%s(?:\s|$)" % re.escape(program), command):
                command = re.sub(r"\s+#[^'\"]*$", "", command) + " " + args
        script.append(command)
    return "\n".join(script) + "\n"


def run_block(script, where, repo, build, problems):
    with tempfile.TemporaryDirectory(prefix="doc-test.") as scratch:
        for entry in REPO_DIRS + TOP_FILES:  # not a run/ that someone left in the checkout
            if os.path.exists(os.path.join(repo, entry)):
                os.symlink(os.path.join(repo, entry), os.path.join(scratch, entry))
        os.mkdir(os.path.join(scratch, "build"))
        os.symlink(build, os.path.join(scratch, "build", "release"))
        try:
            out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=scratch,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            problems.add(where, "run", "the block ran over %d s" % RUN_TIMEOUT)
            return
        if out.returncode != 0:
            tail = "\n".join("    | " + l for l in out.stdout.splitlines()[-15:])
            problems.add(where, "run", "the block exited with %d; its script:\n%s\n  its output's "
                         "last lines:\n%s" % (out.returncode,
                                              "\n".join("    $ " + l for l in script.splitlines()),
                                              tail))


# ---------------------------------------------------------------------------------------------

def check_file(doc, repo, build, programs, conforming, run, problems, warnings, anchor_cache):
    with open(os.path.join(repo, doc), encoding="utf-8") as f:
        text = f.read()
    blocks, prose, markers = parse(text)
    for n, _ in markers:
        problems.add("%s:%d" % (doc, n), "run", "a doc-test marker with no code block after it")
    for n, line, kind in prose:
        where = "%s:%d" % (doc, n)
        check_paths(line, where, repo, problems)
        check_links(line, where, doc, repo, problems, anchor_cache)
        for span in code_spans(line):
            span = span.replace("\\|", "|")
            if FLAG_RE.match(span.split()[0] if span.split() else ""):
                check_lone_flags(span, where, programs, problems)
            else:
                check_command(span, where, programs, problems)
    for block in blocks:
        for n, line in block.lines:
            check_paths(line, "%s:%d" % (doc, n), repo, problems)
        if block.lang not in NOT_SHELL:
            for n, command in logical_lines(block):
                check_command(command, "%s:%d" % (doc, n), programs, problems)
        if block.marker:
            where = "%s:%d" % (doc, block.marker[0])
            script = with_settings(block, block.marker[1], where, programs, problems)
            if script is not None and run:
                started = len(problems.items)
                run_block(script, where, repo, build, problems)
                if len(problems.items) == started:
                    print("%s: ran the block of line %d" % (doc, block.start))
    long = long_sentences(prose)
    if doc in conforming:
        for n, words in long:
            problems.add("%s:%d" % (doc, n), "sentence",
                         "a sentence of %d words (at most %d in README.md and docs/)"
                         % (words, MAX_WORDS, ))
    elif long:
        warnings.append("%s: %d sentences over %d words (lines %s)"
                        % (doc, len(long), MAX_WORDS, ", ".join(str(n) for n, _ in long)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", required=True, help="the build directory with the programs")
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), help="the repository (default: this one)")
    parser.add_argument("--conforming", action="append", default=[],
                        help="hold this file to the sentence limit too (for tests)")
    parser.add_argument("--no-run", action="store_true", help="do not run the marked blocks")
    parser.add_argument("files", nargs="*", help="Markdown files relative to the repository "
                        "(default: README.md docs/*.md)")
    args = parser.parse_args()
    repo = os.path.abspath(args.repo)
    build = os.path.abspath(args.build)
    docs = ["README.md"] + sorted(
        os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, "docs", "*.md")))
    files = args.files or docs
    conforming = set(docs) | set(args.conforming)

    problems, warnings, anchor_cache = Problems(), [], {}
    programs = read_help(build, problems)
    for doc in files:
        check_file(doc, repo, build, programs, conforming, not args.no_run, problems, warnings,
                   anchor_cache)
    for w in warnings:
        print("warning: " + w)
    def order(item):
        path, _, line = item[0].rpartition(":")
        return (path, int(line)) if line.isdigit() else (item[0], 0)
    for where, kind, message in sorted(problems.items, key=order):
        print("%s: %s: %s" % (where, kind, message))
    if problems.items:
        print("FAIL: %d problems in %s" % (len(problems.items), ", ".join(files)))
        return 1
    print("ok: %d files name only what exists%s" % (
        len(files), "" if args.no_run else ", and their runnable blocks ran"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
