#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "wordfreq.h"

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ULL;
    }
    return h;
}

void table_init(table *t, size_t nbuckets) {
    t->buckets = calloc(nbuckets, sizeof *t->buckets);
    t->nbuckets = nbuckets;
    t->size = 0;
}

void table_add(table *t, const char *word) {
    size_t b = fnv1a(word) % t->nbuckets;
    for (entry *e = t->buckets[b]; e; e = e->next) {
        if (strcmp(e->word, word) == 0) {
            e->count++;
            return;
        }
    }
    entry *e = malloc(sizeof *e);
    e->word = strdup(word);
    e->count = 1;
    e->next = t->buckets[b];
    t->buckets[b] = e;
    t->size++;
}

entry **table_entries(const table *t) {
    entry **out = malloc((t->size + 1) * sizeof *out);
    size_t k = 0;
    for (size_t b = 0; b < t->nbuckets; b++)
        for (entry *e = t->buckets[b]; e; e = e->next) out[k++] = e;
    out[k] = NULL;
    return out;
}

void table_free(table *t) {
    for (size_t b = 0; b < t->nbuckets; b++) {
        entry *e = t->buckets[b];
        while (e) {
            entry *next = e->next;
            free(e->word);
            free(e);
            e = next;
        }
    }
    free(t->buckets);
}
