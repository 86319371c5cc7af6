#include <stdlib.h>
#include <string.h>
#include "wordfreq.h"

static int by_count_then_word(const void *a, const void *b) {
    const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
    if (x->count != y->count) return x->count < y->count ? 1 : -1;
    return strcmp(x->word, y->word);
}

void sort_entries(entry **entries, size_t n) {
    qsort(entries, n, sizeof *entries, by_count_then_word);
}
