# Entry points for a fresh machine. `make test` installs dependencies, builds and runs every test.
PRESET ?= release
JOBS ?= $(shell nproc)

.PHONY: deps build test test-asan bench train demo gpt-data clean

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

# train_gpt's data: the text of Debian's fortunes package (scripts/install-deps.sh installs it) as
# byte tokens, split 90/10 into $(GPT_DATA)/train.tokens and val.tokens (ARGS adds flags, e.g.
# ARGS="--prepare my.txt" for other text).
GPT_DATA ?= build/gpt-data
gpt-data: build
	./build/$(PRESET)/examples/train_gpt --prepare --out $(GPT_DATA) $(ARGS)

bench: build
	bash scripts/run-bench.sh build/$(PRESET)

clean:
	rm -rf build
