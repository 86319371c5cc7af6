#include <stdio.h>
#include <stdlib.h>
#include "wordfreq.h"

/* wordfreq N < text: the N most frequent words, case-insensitive, with their counts */
int main(int argc, char **argv) {
    long top = argc > 1 ? strtol(argv[1], NULL, 10) : 10;
    table t;
    table_init(&t, 1 << 16);
    const char *w;
    while ((w = next_word(stdin)) != NULL) table_add(&t, w);
    entry **all = table_entries(&t);
    sort_entries(all, t.size);
    for (long i = 0; i < top && all[i]; i++) printf("%7ld %s\n", all[i]->count, all[i]->word);
    free(all);
    table_free(&t);
    return 0;
}
