# The CUDA backend (docs/cuda.md), included by the Makefile. With nvcc on PATH (or NVCC=/path/nvcc) and
# CUDA not 0, `make` compiles src/kernels/cuda/*.cu for Hopper (sm_90a machine code plus compute_90 PTX)
# into $(BUILD)/libds4cuda.a, links one test binary per tests/cuda/test_cuda_*.cu into $(BUILD)/tests/,
# which tests/run.sh runs with the others (without a GPU each prints SKIP and its result line), and
# bench/cuda_*.cu into $(BUILD)/bench/. Without nvcc one line says the backend is left out and nothing
# else changes.
# The sanitizer build passes CUDA=0.
CUDA ?= auto
NVCC ?= nvcc
ifneq ($(CUDA),0)
CUDA_NVCC := $(shell command -v $(NVCC) 2>/dev/null)
ifeq ($(CUDA_NVCC),)
ifeq ($(CUDA),auto)
ifeq ($(MAKELEVEL),0)
$(info ds4: nvcc not found: the CUDA backend is left out (CUDA=0 silences this line))
endif
else
$(error CUDA=$(CUDA) but $(NVCC) is not on PATH)
endif
else
CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(CUDA_NVCC)))
# Hopper: sm_90a machine code (wgmma, setmaxnreg) and compute_90 PTX the driver can compile for later GPUs.
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90
# -fmad=false: no contraction of a·b + c into an FMA, as the cpu build's -ffp-contract=off, so elementwise
# kernels give the cpu's bits.
NVCCFLAGS := -std=c++17 -O2 $(CUDA_ARCH) -fmad=false -Iinclude -Isrc -Werror all-warnings \
             -Xcompiler -Wall,-Wextra,-Werror,-fno-fast-math,-ffp-contract=off,-fPIC
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcublasLt -lcudart_static -ldl -lrt -lpthread -lstdc++
CUDA_SRC  := $(sort $(wildcard src/kernels/cuda/*.cu))
CUDA_OBJ  := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
CUDA_TEST_SRC := $(sort $(wildcard tests/cuda/test_cuda_*.cu))
CUDA_TEST_BIN := $(CUDA_TEST_SRC:tests/cuda/%.cu=$(BUILD)/tests/%)
CUDA_BENCH_SRC := $(sort $(wildcard bench/cuda_*.cu))
CUDA_BENCH_BIN := $(CUDA_BENCH_SRC:bench/%.cu=$(BUILD)/bench/%)

all: $(BUILD)/libds4cuda.a $(BUILD)/libds4cuda.so $(CUDA_TEST_BIN) $(CUDA_BENCH_BIN)

$(CUDA_OBJ): $(BUILD)/%.o: %.cu mk/cuda.mk
	@mkdir -p $(dir $@)
	$(CUDA_NVCC) $(NVCCFLAGS) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

$(BUILD)/libds4cuda.a: $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The plugin the ds4 program opens when a command asks for --device cuda (src/kernels/backend.c): the
# backend and the CUDA runtime, its ds4_* symbols left to the program (linked with -rdynamic), so a run on
# the cpu never loads a CUDA library.
$(BUILD)/libds4cuda.so: $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared $^ -o $@ $(CUDA_LIBS)

$(CUDA_TEST_BIN:%=%.o): $(BUILD)/tests/%.o: tests/cuda/%.cu
	@mkdir -p $(dir $@)
	$(CUDA_NVCC) $(NVCCFLAGS) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

$(CUDA_BENCH_BIN:%=%.o): $(BUILD)/bench/%.o: bench/%.cu
	@mkdir -p $(dir $@)
	$(CUDA_NVCC) $(NVCCFLAGS) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

$(CUDA_BENCH_BIN): $(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/libds4cuda.a $(BUILD)/libds4.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) $(CUDA_LIBS)

# Linked by the C compiler: no relocatable device code, so no device link step is needed.
$(CUDA_TEST_BIN): $(BUILD)/tests/%: $(BUILD)/tests/%.o $(BUILD)/libds4cuda.a $(BUILD)/liboracle.a $(BUILD)/libds4.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS) $(CUDA_LIBS)

-include $(CUDA_OBJ:.o=.d) $(CUDA_TEST_BIN:%=%.d) $(CUDA_BENCH_BIN:%=%.d)
endif
endif
