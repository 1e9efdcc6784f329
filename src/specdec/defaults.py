"""Every engine default in one place (sampling defaults live on SamplingConfig itself)."""

# models
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"

# γ: the reference guide's dynamic rule (§8)
GUIDE_GAMMA_START = 6
GUIDE_GAMMA_MIN = 3
GUIDE_GAMMA_MAX = 12
GUIDE_GAMMA_UP = 0.8
GUIDE_GAMMA_DOWN = 0.4

# γ: the cost-based controller
COST_GAMMA_MAX = 12
COST_GAMMA_START = 4
COST_GAMMA_DECAY = 0.9
COST_GAMMA_PROBE_EVERY = 8
COST_GAMMA_PRIOR_ACCEPT = 0.7

#: γ when the user asks for none in particular
DEFAULT_GAMMA = "auto"
#: bound on γ accepted from users (CLI and server)
MAX_GAMMA = 64
# token trees: most nodes one verification pass may score
MAX_TREE_NODES = 64
TREE_SHAPE = "dynamic"
TREE_WIDTH = 4
TREE_DEPTH = 6
TREE_BRANCHING = (4, 2, 2, 1, 1, 1)
TREE_NODES = 16
TREE_SAMPLE_BRANCHING = (3, 2, 1, 1, 1, 1, 1, 1)  # sampled trees (T > 0): static, siblings drawn from q
TREE_SAMPLE_WIDTH = 2
TREE_BUDGETS = (4, 8, 16, 32)  # node budgets the tree controller chooses from
DEFAULT_TREE = "chain"  # chain | auto | N

# n-gram drafter
NGRAM_MAX = 3
NGRAM_MIN = 1

# seeds: the drafter's generator is seeded with seed + DRAFT_SEED_OFFSET
DRAFT_SEED_OFFSET = 0x5EED

#: dynamic draft length: stop a draft after a token the drafter gives less than this probability
MIN_CONFIDENCE = 0.0
