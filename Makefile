# Entry points for a fresh machine. `make test` installs dependencies, builds and runs every test.
PRESET ?= release
JOBS ?= $(shell nproc)

.PHONY: deps build test test-asan bench train demo clean

deps:
	bash scripts/install-deps.sh

build: deps
	cmake --preset $(PRESET)
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

test-asan:
	$(MAKE) test PRESET=asan

# The main job: train the Fashion-MNIST MLP for one epoch (ARGS adds or overrides flags, e.g.
# make train ARGS="--model cnn --epochs 2").
train: build
	./build/$(PRESET)/examples/train_fashion_mnist $(ARGS)

# The main job, distributed: Fashion-MNIST with DDP on 2 processes through the launcher (one
# epoch of the MLP unless ARGS says otherwise); rank 0 prints the final accuracy.
demo: build
	./build/$(PRESET)/tools/lockstep run --standalone --nproc-per-node 2 \
	  ./build/$(PRESET)/examples/train_fashion_mnist $(ARGS)

bench: build
	bash scripts/run-bench.sh build/$(PRESET)

clean:
	rm -rf build
