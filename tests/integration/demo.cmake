# demo: the README's main job (scripts/demo.sh) on this build, on both routes: exit 0, both
# turns' replies the same as the decoder alone's, and on the shared route turn 2's line with
# the first turn's tokens cached.
add_test(NAME demo_shared_route
         COMMAND sh -c "out=$(KVSHARE_BUILD_DIR='${CMAKE_BINARY_DIR}' '${PROJECT_SOURCE_DIR}/scripts/demo.sh' 2>&1) || { echo \"$out\"; exit 1; }; \
echo \"$out\"; [ $(echo \"$out\" | grep -c '(the same)') -eq 2 ] && echo \"$out\" | grep -q 'prompt tokens, [0-9]* cached: prefill'")
add_test(NAME demo_file_route
         COMMAND sh -c "out=$(KVSHARE_DEMO_ROUTE=file KVSHARE_BUILD_DIR='${CMAKE_BINARY_DIR}' '${PROJECT_SOURCE_DIR}/scripts/demo.sh' 2>&1) || { echo \"$out\"; exit 1; }; \
echo \"$out\"; [ $(echo \"$out\" | grep -c '(the same)') -eq 2 ] && echo \"$out\" | grep -q 'prompt tokens: prefill .* restore'")
set_tests_properties(demo_shared_route demo_file_route PROPERTIES TIMEOUT 300)
