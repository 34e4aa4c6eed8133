# ds4 build. `make` builds build/libds4.a, build/ds4 and the C tests; `make test` runs every test;
# `make asan` builds and runs the C tests under AddressSanitizer + UBSan in build-asan/.
BUILD   ?= build
CC      ?= gcc
OPT     ?= -O2
SAN     ?=
CFLAGS  := -std=c17 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-psabi -fopenmp $(OPT) $(SAN) -g \
           -Iinclude -Isrc -fno-fast-math -ffp-contract=off
LDLIBS  := -lm -lcjson -lpcre2-8 -fopenmp $(SAN)
# Open MPI (scripts/install-deps.sh installs it); without it ds4 runs as one process only.
MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell mpicc --showme:link 2>/dev/null)
ifneq ($(MPI_CFLAGS),)
CFLAGS  += $(MPI_CFLAGS) -DDS4_HAVE_MPI
LDLIBS  += $(MPI_LIBS)
endif

# The kernels' x86 engines (src/kernels/x86/) are compiled only for an x86-64 target (the compiler's
# own target; X86_64=0 leaves them out on any host, as a non-x86 target does; DS4_NO_X86_DIR tells the
# dispatch they are absent).
X86_64    ?= $(if $(filter x86_64-%,$(shell $(CC) -dumpmachine)),1,0)
LIB_SRC   := $(sort $(wildcard src/*/*.c src/*/*/*.c))
ifneq ($(X86_64),1)
LIB_SRC   := $(filter-out src/kernels/x86/%,$(LIB_SRC))
CFLAGS    += -DDS4_NO_X86_DIR
endif
# The scalar reference kernels (src/kernels/ref/: the tests' oracles) go into a library of their own
# that only the tests link: the program never runs them.
ORACLE_SRC := $(filter src/kernels/ref/%,$(LIB_SRC))
LIB_SRC   := $(filter-out src/kernels/ref/%,$(LIB_SRC))
LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/%.o)
ORACLE_OBJ := $(ORACLE_SRC:%.c=$(BUILD)/%.o)
TEST_SRC  := $(sort $(wildcard tests/test_*.c))
TEST_BIN  := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
TOOL_SRC  := $(sort $(wildcard tools/*.c))
TOOL_OBJ  := $(TOOL_SRC:%.c=$(BUILD)/%.o)
BENCH_SRC := $(sort $(wildcard bench/*.c))
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)

# The cpu kernels (src/kernels/cpu/*.c) once more per ISA level above generic, with the level's -m flags
# (those the dispatch checks the CPU for) and -fvisibility=hidden: the level's files are linked into one
# object (ld -r) whose hidden symbols are then made local (objcopy --localize-hidden), so the only global
# it keeps is its table, ds4_cpu_kernels_<level> (cpu/backend.c); the plain objects are the generic level.
# Same sources, same -ffp-contract=off: the dispatch (dispatch.c) picks the table of the ISA level. The
# folder keeps no static variables (a level would have its own copy of each): the build checks that too.
# (AddressSanitizer adds the table's ODR indicator, __odr_asan.ds4_cpu_kernels_<level>.)
# Only for an x86-64 target and not in the portable-only library (-DDS4_PORTABLE_ONLY).
CPU_LEVEL_SRC := $(sort $(wildcard src/kernels/cpu/*.c))
CPU_LEVELS    := $(if $(filter 1,$(X86_64)),$(if $(filter -DDS4_PORTABLE_ONLY,$(OPT) $(SAN)),,avx2 avx512))
CPU_FLAGS_avx2   := -mavx2 -mfma
CPU_FLAGS_avx512 := -mavx2 -mfma -mavx512f -mavx512vl -mavx512bw -mavx512dq
CPU_LEVEL_OBJ := $(CPU_LEVELS:%=$(BUILD)/kernels-cpu-%.o)
LD      ?= ld
OBJCOPY ?= objcopy
NM      ?= nm
ifneq ($(CPU_LEVELS),)
CFLAGS    += -DDS4_CPU_LEVELS
endif

# NO_BENCH=1 leaves the bench programs out (the sanitizer build: no test runs them).
all: $(BUILD)/ds4 $(TEST_BIN) $(if $(NO_BENCH),,$(BENCH_BIN))

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# $(call cpu_level,LEVEL): its objects under $(BUILD)/levels/LEVEL/ and the one object they make.
define cpu_level
$(BUILD)/levels/$(1)/%.o: %.c
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) $$(CPU_FLAGS_$(1)) -fvisibility=hidden -DDS4_CPU_LEVEL=$(1) -MMD -MP -c $$< -o $$@

$(BUILD)/kernels-cpu-$(1).o: $(CPU_LEVEL_SRC:%.c=$(BUILD)/levels/$(1)/%.o)
	$$(LD) -r -o $$@.tmp $$^
	$$(OBJCOPY) --localize-hidden $$@.tmp $$@.tmp
	@globals=$$$$($$(NM) -g --defined-only $$@.tmp | awk '$$$$3 != "__odr_asan.ds4_cpu_kernels_$(1)" {print $$$$3}'); \
	 if [ "$$$$globals" != ds4_cpu_kernels_$(1) ]; then \
	     echo "$$@: expected one global symbol, ds4_cpu_kernels_$(1); found: $$$$globals" >&2; exit 1; fi
	@state=$$$$($$(NM) $$@.tmp | awk '$$$$2 ~ /^[bBdD]$$$$/ && $$$$3 !~ /^(__odr_asan[.])?ds4_cpu_kernels_$(1)$$$$/ {print $$$$3}'); \
	 if [ -n "$$$$state" ]; then echo "$$@: src/kernels/cpu/ must hold no static variables (each level would" \
	     "have its own copy); found: $$$$state" >&2; exit 1; fi
	mv $$@.tmp $$@
endef
$(foreach l,$(CPU_LEVELS),$(eval $(call cpu_level,$(l))))

$(BUILD)/libds4.a: $(LIB_OBJ) $(CPU_LEVEL_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/liboracle.a: $(ORACLE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The whole library, its symbols exported: a backend plugin the program opens (mk/cuda.mk's libds4cuda.so)
# calls into it.
$(BUILD)/ds4: $(TOOL_OBJ) $(BUILD)/libds4.a
	$(CC) $(CFLAGS) -rdynamic $(TOOL_OBJ) -Wl,--whole-archive $(BUILD)/libds4.a -Wl,--no-whole-archive -o $@ $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(BUILD)/liboracle.a $(BUILD)/libds4.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# The benches too (bench/train_step runs on --device cuda: the plugin calls into the whole library).
$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/libds4.a
	$(CC) $(CFLAGS) -rdynamic $< -Wl,--whole-archive $(BUILD)/libds4.a -Wl,--no-whole-archive -o $@ $(LDLIBS)

test: all
	BUILD=$(BUILD) bash tests/run.sh

test-c: all
	BUILD=$(BUILD) DS4_SKIP_PY=1 bash tests/run.sh

# The C tests under AddressSanitizer + UBSan; runs of more than two MPI ranks are left to the suite without
# sanitizers (four oversubscribed ranks under them took minutes on a 2-core machine).
asan:
	DS4_TEST_MAX_RANKS=2 $(MAKE) CUDA=0 NO_BENCH=1 BUILD=build-asan OPT="-O1" SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test-c

# The C tests again on the portable kernels (DS4_ISA=generic: what a CPU without AVX2 or a non-x86 target
# runs) with the Python tests that compare kernels (PyTorch parity, the ISA flag); the other Python tests
# drive the CLI and tools over the same kernels, and the golden test pins DS4_ISA=generic itself and already
# ran. The runs of four MPI ranks are left to the first pass: they repeat the two-rank runs' kernels on other
# layouts. Then the parity test once per ISA level between generic and this CPU's best.
GENERIC_PY := test_parity.py test_parity_bf16.py test_cli_isa.py
test-levels: all
	DS4_ISA=generic DS4_TEST_MAX_RANKS=2 DS4_SKIP_GOLDEN=1 DS4_PY_ONLY="$(GENERIC_PY)" BUILD=$(BUILD) bash tests/run.sh
	BUILD=$(BUILD) bash tests/run-levels.sh

# The library built without any x86 engine (-DDS4_PORTABLE_ONLY, as a non-x86 target builds it) and for
# the x86-64 baseline; its kernel tests run on the portable engines.
portable:
	$(MAKE) CUDA=0 BUILD=build-portable OPT="-O2 -march=x86-64 -DDS4_PORTABLE_ONLY" \
	    build-portable/tests/test_kernels_basic build-portable/tests/test_kernels_bf16
	build-portable/tests/test_kernels_basic && build-portable/tests/test_kernels_bf16

# The README's test command: all tests (best engines, then portable ones), the portable-only build, the C
# tests under ASan + UBSan, then the fuzzers for 45 s.
check:
	$(MAKE) layers
	$(MAKE) test
	$(MAKE) test-levels
	$(MAKE) portable
	$(MAKE) asan
	$(MAKE) fuzz FUZZ_SECONDS=45

# Layers only point down (core <- io, kernels <- model <- memory, dist <- train <- tools).
layers:
	bash scripts/check-layers.sh

clean:
	rm -rf build build-asan build-portable

.PHONY: all test test-c test-levels portable asan check layers clean
.SECONDARY:
-include $(LIB_OBJ:.o=.d) $(foreach l,$(CPU_LEVELS),$(CPU_LEVEL_SRC:%.c=$(BUILD)/levels/$(l)/%.d)) $(ORACLE_OBJ:.o=.d) $(TOOL_OBJ:.o=.d) $(TEST_BIN:%=%.d) $(BENCH_BIN:%=%.d)

# libFuzzer targets (clang): replays tests/fuzz/regressions, then fuzzes FUZZ_SECONDS in total (<= 60).
FUZZ_SECONDS ?= 60
fuzz:
	bash tests/fuzz/run.sh $(FUZZ_SECONDS)
.PHONY: fuzz
include mk/cuda.mk
