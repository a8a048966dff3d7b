# parle_hvd: the two commands a user needs are `make run` and `make test`.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
TSTAMP := $(VENV)/.test-deps-done
NP    ?= 2
CONFIG ?= configs/fashion_parle.yaml

.PHONY: setup run test test-fast bench-quick bench results claims clean-runs

# Always re-runs: idempotent, and seconds when everything is already there.
setup:
	launch/setup.sh
	@touch $(STAMP)

$(STAMP): launch/setup.sh requirements.txt pyproject.toml
	launch/setup.sh
	@touch $(STAMP)

# What the suite's SLURM and two-host tests need (slurm-wlm, sshd, iproute2).
$(TSTAMP): $(STAMP)
	PARLE_HVD_TEST_DEPS=1 launch/setup.sh
	@touch $(TSTAMP)

# Train the default config on $(NP) local ranks (horovodrun --gloo).
run: $(STAMP)
	NP=$(NP) CONFIG=$(CONFIG) launch/local.sh $(ARGS)

# The whole suite: unit, multi-rank (Gloo and MPI), integration, cluster (SLURM, two hosts).
test: $(TSTAMP)
	$(PY) -m pytest -q -ra --durations=15

# Unit tier only (single process, seconds).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multirank and not integration and not cluster"

# Every benchmark in its --quick mode (each under a minute), printing `name: value` lines.
bench-quick: $(STAMP)
	@for b in overhead pipeline sync_cost dpsgd_engines communication time_to_accuracy split_data commit_cost data_scale; do \
	    echo "== bench.$$b --quick"; $(PY) -m bench.$$b --quick || exit 1; done

# The full benchmarks (the figures in docs/RESULTS.md come from `make results`).
bench: $(STAMP)
	@for b in overhead pipeline sync_cost dpsgd_engines communication time_to_accuracy split_data commit_cost data_scale; do \
	    echo "== bench.$$b"; $(PY) -m bench.$$b || exit 1; done

# Regenerate docs/RESULTS.md (about 35 minutes on 2 cores; needs root for the throttled hosts).
results: $(TSTAMP)
	PY=$(PY) scripts/results.sh

# The paper's claims, tested (docs/CLAIMS.md): every sweep behind the page, then the page.
# About 2.5 hours on 2 cores, needs root for the throttled hosts; resumable (finished runs are
# cached in reports/), so a second call only rewrites the page. Long: run it in the background,
#   nohup make claims > claims.log 2>&1 &
claims: $(TSTAMP)
	PY=$(PY) scripts/claims_sweep.sh

clean-runs:
	rm -rf runs/
